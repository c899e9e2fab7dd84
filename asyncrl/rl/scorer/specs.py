"""What a scorer actor serves, as one typed value: `TeacherSpec`, `RewardSpec` or `JudgeSpec`
(a tagged union, `ScorerSpec`, that crosses to the actor's process as itself). Each builds its own
`Scorer` (`build`), so the actor picks no class by name; `scorer_spec` is the one place that reads
a config section's kind to choose one. Torch-free: the driver builds specs without loading a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import msgspec

from asyncrl.rl.config.teacher import DEFAULT_VERDICT, RewardModelConfig, ScorerConfig, TeacherConfig

if TYPE_CHECKING:
    import torch

    from asyncrl.rl.scorer.base import Scorer


class TeacherSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="teacher"):
    """A teacher's per-token log-probs at ``temperature`` (``teacher_logprobs``), or with ``top_k``
    > 0 its ``top_k`` most likely tokens at each position (``teacher_topk``)."""

    temperature: float = 1.0
    top_k: int = 0

    loading: ClassVar[str] = "teacher"
    """What a start-up phase calls the model it loads."""
    parses_verdicts: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, not {self.temperature!r}")
        if isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, not {self.top_k!r}")

    def build(self, model_path: str, device: torch.device) -> Scorer:
        from asyncrl.rl.scorer.teacher import TeacherScorer

        return TeacherScorer(model_path, device, temperature=self.temperature, top_k=self.top_k)


class RewardSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="reward"):
    """A sequence-classification reward model's scalar per completion (``rewards``)."""

    loading: ClassVar[str] = "reward model"
    parses_verdicts: ClassVar[bool] = False

    def build(self, model_path: str, device: torch.device) -> Scorer:
        from asyncrl.rl.scorer.reward import RewardScorer

        return RewardScorer(model_path, device)


class JudgeSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="judge"):
    """A generative judge's verdict per completion (``rewards``; None where it did not parse):
    `Judge`'s options, the student's tokenizer (``student_path``) and the template's text (read by
    the driver: the actor may run on another node) among them."""

    student_path: str
    template: str
    read: str = "logprob"
    verdict_tokens: tuple[str, str] = ("yes", "no")
    verdict: str = DEFAULT_VERDICT
    max_new_tokens: int = 16

    loading: ClassVar[str] = "judge"
    parses_verdicts: ClassVar[bool] = True
    """Its verdicts may not parse: the driver counts them (`RewardModel`)."""

    def build(self, model_path: str, device: torch.device) -> Scorer:
        from asyncrl.rl.scorer.judge import Judge, JudgeScorer

        return JudgeScorer(
            Judge(
                model_path,
                self.student_path,
                self.template,
                read=self.read,
                verdict_tokens=self.verdict_tokens,
                verdict=self.verdict,
                max_new_tokens=self.max_new_tokens,
                device=device,
            )
        )


ScorerSpec = TeacherSpec | RewardSpec | JudgeSpec


def scorer_spec(section: ScorerConfig, student_path: str, temperature: float) -> ScorerSpec:
    """What the scorer of a config section (``--teacher.*``, ``--reward_model.*``) serves: a
    teacher at the samplers' ``temperature``, a reward model, or a judge reading the student's
    token ids with the tokenizer at ``student_path`` (its template read here)."""
    if isinstance(section, TeacherConfig):
        return TeacherSpec(temperature=temperature, top_k=section.top_k)
    if isinstance(section, RewardModelConfig) and section.kind == "judge":
        with open(section.template, encoding="utf-8") as f:
            template = f.read()
        return JudgeSpec(
            student_path=student_path,
            template=template,
            read=section.judge_read,
            verdict_tokens=section.verdict_tokens,
            verdict=section.verdict,
            max_new_tokens=section.max_new_tokens,
        )
    return RewardSpec()
