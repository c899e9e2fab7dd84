"""`make_scorer`: the `Scorer` a `ScorerSpec` stands for (each spec builds its own: ``specs.py``),
its loading told to the supervisor first."""

from __future__ import annotations

import torch

from asyncrl.rl.scorer.base import Scorer
from asyncrl.rl.scorer.specs import ScorerSpec
from asyncrl.runtime.startup import start_phase


def make_scorer(spec: ScorerSpec, model_path: str, device: torch.device) -> Scorer:
    """The scorer ``spec`` describes, for ``model_path`` on ``device``. A loader's refusal
    (`RewardModelError`, `JudgeError`) propagates."""
    start_phase(f"loading the {spec.loading} {model_path}")
    return spec.build(model_path, device)
