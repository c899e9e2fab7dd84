"""A multi-turn environment with no tool: find a secret number from 1 to 20 by guessing.

    asyncrl launch examples/grpo.py --task.name examples/guess.py:Guess

Each model turn is a guess (`` 10``); the environment answers `` higher:`` or `` lower:`` (a
``user`` message, context rather than a target), or ends the episode when the guess is right:
reward 1, less 0.1 for each extra guess. An episode still open after five guesses (enough for a
binary search of 20) is truncated with reward 0. Metrics: ``no_guess`` (a turn without a number),
``ignored_reply`` (a guess on the wrong side of an earlier answer); the runner adds ``turns``.

The warm start's demonstrations are binary searches, each with its first guess drawn at random
(a hash of the problem picks one of 6 to 15), so the warm-started model has to read the replies
to find the secret, and GRPO has the number of guesses to bring down.
"""

from __future__ import annotations

import random
import re
import zlib

from asyncrl.rl.tasks import Environment, Reply

LOW, HIGH = 1, 20
_NUMBER = re.compile(r"\d{1,3}")


class Guess(Environment):
    """Find a secret number from 1 to 20; after each wrong guess the environment says higher or lower."""

    name = "guess"
    max_turns = 5
    truncated_reward = 0.0

    def problems(self):  # deterministic: every process builds these itself
        rng = random.Random(0)
        return [{"id": i, "secret": rng.randint(LOW, HIGH)} for i in range(4000)]

    def prompt(self, problem) -> str:
        return f"Guess my number ({LOW}-{HIGH}):"

    def step(self, episode, completion: str) -> Reply:
        found = _NUMBER.search(completion)
        if found is None:  # no guess at all: the episode ends, unrewarded
            return Reply(done=True, reward=0.0, metrics={"no_guess": 1})
        guess, secret = int(found.group()), episode.problem["secret"]
        low, high = episode.state.get("range", (LOW, HIGH))
        ignored = not low <= guess <= high
        if guess == secret:  # fewer guesses, more reward
            return Reply(
                done=True,
                reward=1.0 - 0.1 * (episode.model_turns - 1),
                correct=True,
                metrics={"ignored_reply": ignored},
            )
        episode.state["range"] = (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))
        return Reply(" higher:" if guess < secret else " lower:", role="user", metrics={"ignored_reply": ignored})

    def demonstration(self, problem) -> list[str]:
        """A binary search from a first guess of 6 to 15: the guesses, and the answers between them."""
        secret, low, high = problem["secret"], LOW, HIGH
        guess = 6 + zlib.crc32(str(problem["id"]).encode()) % 10
        turns = []
        while True:
            turns.append(f" {guess}")
            if guess == secret:
                return turns
            turns.append(" higher:" if guess < secret else " lower:")
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
            guess = (low + high) // 2
