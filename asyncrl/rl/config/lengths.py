"""`LengthProfile`: completion lengths drawn from a distribution, for synthetic long generations.

A model with random weights never stops by itself: every completion runs to ``max_new_tokens``,
so a benchmark at 8k tokens would measure a workload with no tail at all, the regime where
asynchrony gains least. ``--sampler.lengths PROFILE`` makes each completion run exactly a length
drawn from a profile instead (`SamplingParams.exact_lengths`):

* ``uniform:N``: every completion N tokens;
* ``lognormal:N``: median N/4, log-standard-deviation 0.8, capped at N (about 4% of completions
  reach the cap and stop there, as truncated ones do). The shape is the one reasoning models'
  response lengths are reported to have under RL (right-skewed, a long tail, a pile-up at the
  length limit); the median and the spread are our choice, not fitted to any one model.

Draws come from the sampler's own seeded generator, so a run repeats its lengths.
"""

from __future__ import annotations

import math
import random

import msgspec

LONG_COMPLETIONS = 4096
"""Completion tokens (``--sampler.max_new_tokens``, or the ``--sampler.lengths`` cap) from which
completions count as long, and the defaults follow: a colocated GPU's auto staleness is 2, and
vLLM samplers count their engines' preemptions. The bottom of the long-reasoning range, where a
step's long tail outlasts a train step (docs/grpo.md, "Long generations", has the runs)."""

KINDS = ("uniform", "lognormal")
LOG_SIGMA = 0.8
"""The lognormal profile's spread: P(length >= cap) = P(Z >= ln 4 / 0.8) ~ 4%."""


class LengthProfile(msgspec.Struct, frozen=True):
    """``kind`` (`KINDS`) and ``cap``, the longest completion, in tokens."""

    kind: str
    cap: int

    @classmethod
    def parse(cls, text: str) -> LengthProfile | None:
        """``"kind:N"`` as a profile; "" as None (lengths the model's own). ValueError, naming the
        forms, for anything else."""
        if not text:
            return None
        kind, _, cap = text.partition(":")
        if kind not in KINDS or not cap.isdigit() or int(cap) < 1:
            raise ValueError(f"lengths must be 'uniform:N' or 'lognormal:N' with N >= 1 tokens, not {text!r}")
        return cls(kind, int(cap))

    def draw(self, rng: random.Random) -> int:
        """One completion's length, in [1, cap]."""
        if self.kind == "uniform":
            return self.cap
        median = self.cap / 4
        return max(1, min(self.cap, round(math.exp(rng.gauss(math.log(median), LOG_SIGMA)))))
