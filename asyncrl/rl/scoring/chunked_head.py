"""The output layer and the log-softmax taken together, a chunk of tokens at a time: per-token
log-probs of the sampled tokens from the final hidden states, without a ``[tokens, vocab]`` float32
logits tensor ever existing whole.

With a 151,936-token vocabulary the logits of a 16k-token micro-batch are 9.2 GiB per float32
copy, and the old path kept about two (the float32 logits for ``logsumexp``'s backward, the bf16
ones autocast made). Here each chunk of ``C`` tokens makes a ``[C, V]`` temporary of about
``chunk_bytes`` and the backward recomputes it from the saved hidden states (one more matmul per
chunk: the head is ~1/(2 x layers) of a decoder's forward FLOPs, so this costs a few per cent).

Why not Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (read in liger-kernel 0.8.5,
``chunked_loss/fused_linear_ppo.py``, where this chunked-recompute idea is also used): it fuses the
head with ITS loss (plain ``exp`` of the ratio, its own clip/TIS/normaliser variants, a padded
``[B, T, H]`` input, ``torch.compile`` on the loss). Ours (``loss.py``: safe exp, truncated IS,
k3 KL, a cross-micro-batch normaliser, packed rows) stays one set of formulas on CPU and GPU, and
only the log-probs, the part that costs memory, are fused here: no new dependency, no Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_BYTES = 256 << 20
"""Bytes of one chunk's float32 ``[C, V]`` logits; the forward's peak temporaries are about three
of these (the chunk, its log-softmax, the matmul's own-dtype output)."""


def chunk_tokens(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one ``[C, V]`` float32 block is about ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * max(vocab_size, 1)))


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    *,
    compute_dtype: torch.dtype | None = None,
    chunk: int = 0,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[N]`` float32 log-probs of ``targets`` under ``softmax((hidden @ weight.T + bias) / T)``,
    and (with ``entropy``) the ``[N]`` entropy of that distribution, a metric with no gradient.
    ``targets`` ``[N, M]`` gives ``[N, M]``: the log-probs of M ids at each position (the sampled
    token and a teacher's top-K, distillation), gathered from the same chunk of logits.

    ``hidden`` is ``[N, H]`` (after the model's final norm), ``weight`` ``[V, H]``. The matmul runs
    in ``compute_dtype`` (the autocast dtype where the model's forward runs under autocast, as its
    own head would; None: the weight's), everything after it in float32. Differentiable wrt
    ``hidden``, ``weight`` and ``bias``; under ``torch.no_grad`` (the KL reference) nothing is
    saved. ``chunk``: tokens per chunk (0: `chunk_tokens`)."""
    dtype = compute_dtype or weight.dtype
    chunk = chunk or chunk_tokens(weight.shape[0])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        lp, ent = _ChunkedHead.apply(hidden, weight, bias, targets, float(temperature), dtype, chunk, entropy)
        return lp, (ent if entropy else None)
    lp, _, ent = _forward(hidden, weight, bias, targets, float(temperature), dtype, chunk, entropy)
    return lp, ent


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    # F.linear as nn.Linear computes it (the same bias add), then float32 as the old `.float() / T`
    return F.linear(h, weight, bias).float() / temperature


def _forward(hidden, weight, bias, targets, temperature, dtype, chunk, entropy):
    n = hidden.shape[0]
    w = weight.to(dtype)  # one cast per call, as autocast's weight cache does per forward
    b = None if bias is None else bias.to(dtype)
    lp = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if entropy else None
    with torch.no_grad():
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk].to(dtype), w, b, temperature)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            lp[s : s + chunk] = _gathered(z, targets[s : s + chunk]) - _column(lse[s : s + chunk], lp)
            if ent is not None:  # token_entropy's formula, on the same chunk
                logp = z - lse[s : s + chunk, None]
                ent[s : s + chunk] = -(logp.exp() * logp).sum(-1)
    return lp, lse, ent


def _gathered(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return z.gather(-1, ids[:, None]).squeeze(-1) if ids.dim() == 1 else z.gather(-1, ids)


def _column(lse: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return lse if like.dim() == 1 else lse[:, None]


@torch.no_grad()
def head_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    temperature: float,
    *,
    compute_dtype: torch.dtype | None = None,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, k]`` float32 log-probs and ``[N, k]`` ids of the ``k`` most likely tokens (``k`` at
    most the vocabulary) under ``softmax((hidden @ weight.T + bias) / T)``, most likely first: a
    teacher's top-K (distillation), a chunk of positions at a time as `head_logprobs`."""
    dtype = compute_dtype or weight.dtype
    chunk = chunk or chunk_tokens(weight.shape[0])
    w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
    values = torch.empty(hidden.shape[0], k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        z = _chunk_logits(hidden[s : s + chunk].to(dtype), w, b, temperature)
        top = torch.topk(z, k, dim=-1)
        values[s : s + chunk] = top.values - torch.logsumexp(z, dim=-1, keepdim=True)
        ids[s : s + chunk] = top.indices
    return values, ids


class _ChunkedHead(torch.autograd.Function):
    """Saves the inputs and each token's logsumexp (``[N]``), never the logits; the backward
    recomputes a chunk's logits and takes ``d lp / d z = onehot(target) - softmax(z)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, dtype, chunk, entropy):
        lp, lse, ent = _forward(hidden, weight, bias, targets, temperature, dtype, chunk, entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.dtype, ctx.chunk = temperature, dtype, chunk
        ent = ent if ent is not None else lp.new_empty(0)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        t, dtype, chunk = ctx.temperature, ctx.dtype, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        # float32 sums across chunks whatever the compute dtype (autocast's one big matmul
        # accumulates in float32 inside the kernel)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        grad_lp = grad_lp.float()
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(dtype)
            g = grad_lp[s : s + chunk]
            z = _chunk_logits(h, w, b, t)
            ids = targets[s : s + chunk]
            g = g if g.dim() == 2 else g[:, None]  # d lp_m / d z = onehot(id_m) - softmax, summed over m
            dz = torch.exp(z - lse[s : s + chunk, None]).mul_(-g.sum(-1, keepdim=True))  # -g * softmax
            dz.scatter_add_(-1, ids if ids.dim() == 2 else ids[:, None], g)  # + g * onehot
            dz = dz.div_(t).to(dtype)  # z = logits / T; autocast's logits were `dtype`
            if grad_h is not None:
                grad_h[s : s + chunk] = (dz @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (dz.t() @ h).float()
            if grad_b is not None:
                grad_b += dz.float().sum(0)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )
