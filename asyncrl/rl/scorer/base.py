"""`Scorer`: what the scorer actor serves requests through, one implementation per kind of model
(``teacher.py``, ``reward.py``, ``judge.py``), made from the config's kind by ``factory.py``. The
actor owns the queue, the passes and the deadlines; a scorer only computes a pass's answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from asyncrl.rl.rollout import TeacherTopK
from asyncrl.rl.scoring.batch import ScoreRequest

Answer: TypeAlias = Sequence[Sequence[float]] | TeacherTopK | Sequence[float | None]
"""One request's answer, as its endpoint returns it: a teacher's log-probs per completion, a
teacher's top-K, or a reward per completion (None: a judge's verdict that did not parse)."""


@dataclass(frozen=True)
class Scored:
    """One pass's answers: ``answers[i]`` is the answer to the pass's request ``i`` (the value the
    endpoint returns), ``forwards`` the model calls it took, ``unparsed`` a judge's verdicts that
    did not parse (a score of None)."""

    answers: Sequence[Answer]
    forwards: int
    unparsed: int = 0


class Scorer(Protocol):
    """A model that scores ``(prompt_ids, completion_ids)`` requests, a batch at a time."""

    kind: str
    """"teacher", "reward" or "judge": what the model is, as a refused request names it."""
    endpoint: str
    """The one endpoint of the actor it answers: "teacher_logprobs", "teacher_topk" or "rewards"."""
    vocab: int
    """Token ids a request may carry lie in [0, vocab)."""
    vocabulary: str
    """What an id outside [0, vocab) is outside of (for the error that refuses it)."""

    def score(self, requests: list[ScoreRequest], budget: int) -> Scored:
        """The answers to ``requests``, at most ``budget`` padded tokens a forward (blocking: the
        actor runs it off its event loop, under ``torch.no_grad``)."""
        ...
