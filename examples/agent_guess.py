"""A multi-turn agent that keeps its own message list: no environment class, no task class.

    asyncrl launch examples/grpo.py --task.name examples/agent_guess.py:guess_number \
        --task.data examples/data/guess_numbers.jsonl --model_path ~/ckpt/Qwen2.5-0.5B-Instruct \
        --task.score_timeout_s 120

An agent is an async function of a problem (a row of ``--task.data``) and an ``openai.AsyncOpenAI``
client. This one plays "guess my number": the model guesses, the agent answers "higher" or
"lower" in the same conversation, up to ``TURNS`` guesses; the reward is 1 for finding the number,
less the more guesses it took. Each turn extends the previous one, so the whole game is one
training sample: the model's guesses are trained on, the agent's replies are masked context
(docs/agents.md).
"""

from __future__ import annotations

import re

from asyncrl.rl.tasks import Score

TURNS = 5
_NUMBER = re.compile(r"-?\d+")


async def guess_number(problem: dict, client) -> Score:
    secret, low, high = int(problem["secret"]), int(problem["low"]), int(problem["high"])
    messages = [
        {"role": "system", "content": "Answer with one number only."},
        {"role": "user", "content": f"I picked a whole number from {low} to {high}. Guess it."},
    ]
    for turn in range(1, TURNS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        text = reply.choices[0].message.content or ""
        found = _NUMBER.findall(text)
        guess = int(found[-1]) if found else None  # model text: parsed, never evaluated
        if guess == secret:
            return Score(1.0 - 0.1 * (turn - 1), correct=True, metrics={"guesses": turn})
        messages += [
            {"role": "assistant", "content": text},
            {
                "role": "user",
                "content": "Give a number." if guess is None else ("Higher." if guess < secret else "Lower."),
            },
        ]
    return Score(0.0, correct=False, metrics={"guesses": TURNS})
