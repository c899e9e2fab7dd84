"""What a generation is asked and what it gives back, shared by the sampler backends, the episode
runner (``tasks/episodes.py``) and the evaluation (``model/evaluation.py``): `SamplingParams`,
`Completion` and `row_seed`. Plain msgspec types, no torch.
"""

from __future__ import annotations

import math

import msgspec

MAX_TOP_LOGPROBS = 20
"""The most alternatives per token `SamplingParams.top_logprobs` may ask (OpenAI's limit too)."""


class SamplingParams(msgspec.Struct, frozen=True):
    """How to sample. ``temperature == 0`` is greedy; ``seed`` makes a call reproducible (each
    completion gets its own generator seeded from ``(seed, prompt index, sample index)``)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = []
    seed: int | None = None
    stop: list[str] = []
    """Stop strings (both backends). A completion ends at the token whose text (decoded as ``text``
    is, special tokens skipped) completes one; ``token_ids`` keep every token, the completing one
    included, ``finish_reason`` is "stop", and ``text`` ends before the string (vLLM's
    ``include_stop_str_in_output=False``). Of several, the one completed first wins."""
    top_logprobs: int = 0
    """Also return, for each generated token, the ``top_logprobs`` most likely tokens of the
    distribution it was drawn from (`Completion.top_logprobs`); 0: none. At most `MAX_TOP_LOGPROBS`."""
    exact_lengths: list[int] = []
    """Synthetic workloads (``--sampler.lengths``): per row of the call (sample j of prompt i is row
    ``i * n + j``), exactly how many tokens it generates, each at most ``max_new_tokens``; stop
    tokens and strings do not end it, and its ``finish_reason`` is "length". Empty: off."""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0 (0: greedy), not {self.temperature!r}")
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, not {self.stop_token_ids!r}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0 or None, not {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(not 1 <= n <= self.max_new_tokens for n in self.exact_lengths):
            raise ValueError(f"exact_lengths must each be in [1, max_new_tokens={self.max_new_tokens}]")
        if isinstance(self.top_logprobs, bool) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {self.top_logprobs!r}")


class VersionSpan(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """From token ``start`` of a completion on (until the next span), its tokens were sampled
    under weight ``version``."""

    start: int
    version: int


class Completion(msgspec.Struct, frozen=True):
    """One sampled continuation of a prompt (prompt tokens not included).

    ``logprobs[t]`` is the log-probability of ``token_ids[t]`` under the distribution it was
    actually drawn from: ``log_softmax(logits / temperature)``, restricted to the top-p nucleus and
    renormalised when ``top_p < 1``. The trainer recomputes log-probs with the same temperature;
    with ``top_p < 1`` the two differ by the log of the nucleus mass (the behaviour policy really
    is the truncated one). For greedy (``temperature == 0``) they are ``log_softmax(logits)``.
    A stop token ends the completion, is included in ``token_ids`` and has its log-prob;
    ``finish_reason`` is ``"stop"`` then, ``"length"`` when ``max_new_tokens`` ran out. ``text`` is
    the decoding of ``token_ids`` without the stop token, special tokens skipped (as the held-out
    evaluation reads completions, so rewards and solve rates score the same text).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] = []
    """With `SamplingParams.top_logprobs` k > 0: per generated token, the k most likely tokens of
    the distribution it was drawn from (the one ``logprobs`` are of) as ``(token id, log-prob)``,
    most likely first; tokens outside the top-p nucleus have -inf. Empty otherwise."""
    version_spans: list[VersionSpan] = []
    """Where the weights changed under this completion while it was generated (a sampler that
    takes weights between decoding steps): the versions its tokens were sampled under, in token
    order, the first span at token 0. Empty: every token was sampled under the weights the call
    began with."""


def changed_spans(spans: list[VersionSpan], length: int) -> list[VersionSpan]:
    """``spans`` (a generation's versions, the first at token 0) as `Completion.version_spans` of
    a completion of ``length`` tokens: those that start within it, and none at all when that
    leaves one (no change under it)."""
    kept = [s for s in spans if s.start < length]
    return kept if len(kept) > 1 else []


_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9)  # odd constants: distinct (seed, prompt, sample) -> distinct streams


def row_seed(seed: int, prompt: int, sample: int) -> int:
    """Seed of completion ``sample`` of prompt ``prompt`` in a call made with ``seed``: a call's
    output depends only on its own arguments, never on what else ran before it."""
    return (seed * _MIX[0] + prompt * _MIX[1] + sample) % (1 << 63)
