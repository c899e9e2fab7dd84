"""The distribution a token is drawn from, read the same way by every generation that reports it:
`sampling_logprobs` (the HF sampler backend's, per decoding step) and `StepLogprobs`, the same read
beside transformers' ``model.generate`` (the held-out evaluation's endpoint for agents), so that an
agent gets the same log-probs and alternatives in held-out evaluation as in training.
"""

from __future__ import annotations

import math

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs ``[B, V]`` of the distribution tokens are drawn from: ``log_softmax(logits / T)``,
    restricted to the nucleus (smallest set of most likely tokens with mass >= top_p) and
    renormalised when ``top_p < 1``. At ``temperature == 0`` (greedy) it is ``log_softmax(logits)``:
    the degenerate greedy distribution would give 0 for every token and tell nothing."""
    logp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    if top_p >= 1.0 or temperature == 0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
    drop_sorted = mass_before >= top_p  # the most likely token always has mass_before 0: never dropped
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, -math.inf)
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


class StepLogprobs:
    """A logits processor for ``model.generate`` (it changes nothing) that keeps, for each
    generated token, its log-prob under `sampling_logprobs` and the ``top`` most likely tokens.
    transformers applies the temperature and top-p after it, so it reads the logits as
    `sampling_logprobs` wants them. A step's token is known only at the next step (or, for the
    last, from the output): one step's distribution is held at a time, never ``[T, B, V]``."""

    def __init__(self, temperature: float, top_p: float, top: int):
        self.temperature, self.top_p, self.top = temperature, top_p, top
        self._held: torch.Tensor | None = None
        self._logprobs: list[torch.Tensor] = []
        self._top_ids: list[torch.Tensor] = []
        self._top_lps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._held is not None:
            self._take(input_ids[:, -1])
        self._held = sampling_logprobs(scores, self.temperature, self.top_p)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        held, self._held = self._held, None
        if held is None:
            raise ValueError("a sampled token taken before the scores it was drawn from")
        self._logprobs.append(held.gather(1, tokens[:, None].to(held.device)).squeeze(1).cpu())
        if self.top:
            top = held.topk(self.top, dim=-1)
            self._top_ids.append(top.indices.cpu())
            self._top_lps.append(top.values.cpu())

    def rows(self, generated: torch.Tensor) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
        """Per row of ``generated`` (``[B, T]``, the tokens after the prompt): each token's
        log-prob, and its ``top`` alternatives as ``(token id, log-prob)`` (empty lists when 0)."""
        if self._held is not None:
            self._take(generated[:, -1])
        rows = len(generated)
        logprobs = torch.stack(self._logprobs, 1).tolist() if self._logprobs else [[] for _ in range(rows)]
        if not self._top_ids:
            return logprobs, [[] for _ in range(rows)]
        ids, lps = torch.stack(self._top_ids, 1).tolist(), torch.stack(self._top_lps, 1).tolist()
        return logprobs, [[list(zip(a, b)) for a, b in zip(i, v)] for i, v in zip(ids, lps)]
