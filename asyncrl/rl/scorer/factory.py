"""`make_scorer`: the `Scorer` of a config's kind, checked before any model is loaded."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.rl.scorer.base import Scorer
from asyncrl.rl.scorer.judge import JudgeScorer
from asyncrl.rl.scorer.reward import RewardScorer
from asyncrl.rl.scorer.teacher import TeacherScorer
from asyncrl.runtime.startup import start_phase

KINDS = ("teacher", "reward", "judge")
_LOADING = {"teacher": "teacher", "reward": "reward model", "judge": "judge"}
"""What a start-up phase calls the model it loads, by kind."""


def make_scorer(
    kind: str,
    model_path: str,
    device: torch.device,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    judge: dict[str, Any] | None = None,
) -> Scorer:
    """The scorer of ``kind`` for ``model_path`` on ``device``: a teacher at ``temperature``
    (``top_k`` > 0: its top-K, a teacher's option only), a reward model, or a judge (``judge``:
    `Judge`'s keyword arguments). A loader's refusal (`RewardModelError`, `JudgeError`) propagates."""
    if kind not in KINDS:
        raise ValueError(f"kind must be 'teacher', 'reward' or 'judge', not {kind!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, not {temperature!r}")
    if top_k < 0 or (top_k and kind != "teacher"):
        raise ValueError(f"top_k must be >= 0, and 0 for a {kind} (a teacher's option), not {top_k!r}")
    start_phase(f"loading the {_LOADING[kind]} {model_path}")
    if kind == "judge":
        return JudgeScorer(model_path, device, judge or {})
    if kind == "reward":
        return RewardScorer(model_path, device)
    return TeacherScorer(model_path, device, temperature=temperature, top_k=top_k)
