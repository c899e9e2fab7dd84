"""The sections of the models that score the student's samples, each served by a scorer actor:
the teacher (``--teacher.*``, on-policy distillation) and the reward model (``--reward_model.*``:
a sequence-classification checkpoint or a generative judge) (docs/algorithms.md)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from asyncrl.rl.config.tree import Section

DEFAULT_VERDICT = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
"""``--reward_model.verdict``'s default: finds "Score: 7", "score=0.5"."""
SCORERS = ("teacher", "reward_model")
"""The config's scorer sections, by key: each is spawned as a `ScorerActor` when its model_path is set."""


@dataclass(frozen=True, kw_only=True)
class ScorerConfig:
    """What every scorer's section has: its checkpoint, its deadline and its batch."""

    model_path: str = ""
    """A local Hugging Face checkpoint directory; empty: none."""
    timeout_s: float = 120.0
    """The longest one group's scoring may take, its wait in the scorer's queue included; past it
    the scorer is restarted (within --run.sampler_max_restarts) and the group scored again."""
    batch_tokens: int = 16384
    """Tokens (prompt + completion) of the requests one scorer pass takes together at most."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {self.timeout_s!r}")
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, not {self.batch_tokens!r}")

    @property
    def shares_tokenizer(self) -> bool:
        """Whether the scorer reads the student's token ids (so must share its tokenizer)."""
        return True


@dataclass(frozen=True, kw_only=True)
class TeacherConfig(ScorerConfig):
    """On-policy distillation's teacher: a local checkpoint served by a scorer actor, which scores
    every completion token the samplers make; ``--trainer.loss.distill_coef`` weighs it. Its
    ``model_path`` must have the student's tokenizer."""

    top_k: int = 0
    """0: the teacher's log-prob of each sampled token, and the reverse KL estimated on it joins
    the advantage. K > 0: the teacher's K most likely tokens and their log-probs at every
    completion position, and the reverse KL over those K tokens plus one bucket for the rest
    joins the loss (lower variance; 8 bytes or so a token x K on the wire). K >= the vocabulary
    is the whole distribution (clamped). docs/algorithms.md."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k must be an integer >= 0 (0: the sampled token only; K: the teacher's K most "
                f"likely tokens), not {self.top_k!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig(ScorerConfig):
    """A reward model served by a scorer actor, whose score of each completion joins the task's
    reward: a sequence-classification checkpoint with one scalar output (``kind classifier``,
    the student's tokenizer), or a causal LM asked through a prompt template (``kind judge``, any
    tokenizer: it reads text)."""

    kind: str = "classifier"
    """"classifier": a sequence-classification checkpoint (num_labels 1, a ``score`` head) scores
    prompt + completion; "judge": a causal LM reads ``template`` filled in and gives a verdict."""
    weight: float = 1.0
    """The reward model's weight: reward = ``rule_weight`` x task reward + ``weight`` x its score."""
    rule_weight: float = 1.0
    """The task's (rule) reward's weight in that sum; 0: the reward model alone."""
    template: str = ""
    """A judge's prompt: a text file in which {prompt} and {completion} are replaced by the
    student's prompt and completion (decoded); it is the judge's whole input (write an instruct
    judge's chat markup into it)."""
    judge_read: str = "logprob"
    """How a judge's verdict is read: "logprob", p(yes) / (p(yes) + p(no)) of the two
    ``verdict_tokens`` after the templated prompt (one forward, deterministic, in [0, 1]);
    "generate", the number ``verdict`` finds in its greedy output of up to ``max_new_tokens``."""
    verdict_tokens: tuple[str, str] = ("yes", "no")
    """A judge's two verdict words (judge_read logprob), the good one first; each must be one token
    of the judge's tokenizer."""
    verdict: str = DEFAULT_VERDICT
    """A regular expression whose first group (or whole match) is the score in a judge's output
    (judge_read generate); an output it does not find a number in is an unparsed verdict."""
    max_new_tokens: int = 16
    """The longest verdict a judge generates (judge_read generate)."""
    max_unparsed_rate: float = 0.2
    """The share of a judge's verdicts that may fail to parse (each counts 0 in the sum); past it,
    after 50 verdicts, the run stops naming the template and the verdict."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("weight", "rule_weight"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, not {getattr(self, name)!r}")
        if self.kind not in ("classifier", "judge"):
            raise ValueError(f"kind must be 'classifier' or 'judge', not {self.kind!r}")
        if self.judge_read not in ("logprob", "generate"):
            raise ValueError(f"judge_read must be 'logprob' or 'generate', not {self.judge_read!r}")
        if len(self.verdict_tokens) != 2 or not all(self.verdict_tokens):
            raise ValueError(f"verdict_tokens must be two words (yes,no), not {self.verdict_tokens!r}")
        try:
            groups = re.compile(self.verdict).groups
        except re.error as exc:
            raise ValueError(f"verdict {self.verdict!r} is not a regular expression: {exc}") from None
        if groups > 1:
            raise ValueError(f"verdict {self.verdict!r} has {groups} groups: one (the number) or none is read")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {self.max_new_tokens!r}")
        if not 0.0 <= self.max_unparsed_rate <= 1.0:
            raise ValueError(f"max_unparsed_rate must be in [0, 1], not {self.max_unparsed_rate!r}")
        if self.model_path and self.kind == "judge" and not self.template:
            raise ValueError("kind judge needs a template: set --reward_model.template FILE ({prompt}, {completion})")
        if self.template and self.kind != "judge":
            raise ValueError(f"template {self.template} is read by a judge only: add --reward_model.kind judge")

    @property
    def shares_tokenizer(self) -> bool:
        return self.kind != "judge"  # a judge decodes the student's ids and reads the text


def scorer_sections(config: Section) -> list[tuple[str, ScorerConfig]]:
    """(key, section) of each scorer ``config`` (a `GRPOConfig`) has, in `SCORERS` order."""
    return [(key, getattr(config, key)) for key in SCORERS if getattr(config, key).model_path]
