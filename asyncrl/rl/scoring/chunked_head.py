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

On CUDA each chunk's elementwise work after the matmul (float32 cast, ``/ T``, logsumexp, gather;
the backward's softmax, one-hot add and cast) runs as one `torch.compile`d function, so Inductor
makes one or two kernels of what eager does in several passes over the ``[C, V]`` chunk, and
the weight's gradient accumulates in float32 inside the matmul (``addmm`` with ``out_dtype``)
instead of through a ``[V, H]`` temporary and its float32 copy. The same Python functions run
eagerly on CPU. ``ASYNCRL_HEAD_FAST=0`` forces the eager path on CUDA too (default on; `FAST`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_BYTES = 256 << 20
"""Bytes of one chunk's float32 ``[C, V]`` logits; the forward's peak temporaries are about three
of these (the chunk, its log-softmax, the matmul's own-dtype output)."""

FAST: bool | None = None
"""The compiled chunk functions and the in-matmul float32 accumulation on CUDA: None reads
``ASYNCRL_HEAD_FAST`` at each call (unset or anything but ``0``: on); True or False overrides it
(``benchmarks/head_bench.py`` compares both paths in one process)."""


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
    stats = _chunk_fns(hidden.device)[0]
    with torch.no_grad():
        for s in range(0, n, chunk):
            logits = F.linear(hidden[s : s + chunk].to(dtype), w, b)  # as nn.Linear computes it
            lp_c, lse_c, ent_c = stats(logits, targets[s : s + chunk], temperature, entropy)
            lp[s : s + chunk], lse[s : s + chunk] = lp_c, lse_c
            if ent is not None:
                ent[s : s + chunk] = ent_c
    return lp, lse, ent


def chunk_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's log-probs of ``ids``, its ``[C]`` logsumexp and (``entropy``) its entropy, from
    the matmul's ``[C, V]`` logits: the forward's elementwise part, compiled on CUDA (`_chunk_fns`)."""
    z = logits.float() / temperature  # the old `.float() / T`: fused into the kernel that reads it
    lse = torch.logsumexp(z, dim=-1)
    lp = _gathered(z, ids) - _column(lse, ids)
    ent = None
    if entropy:  # token_entropy's formula, on the same chunk
        logp = z - lse[:, None]
        ent = -(logp.exp() * logp).sum(-1)
    return lp, lse, ent


def chunk_grad_logits(
    logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, ids: torch.Tensor, temperature: float, dtype: torch.dtype
) -> torch.Tensor:
    """``d loss / d logits`` of one chunk in ``dtype`` from the recomputed logits, the forward's
    logsumexp and the upstream ``g`` (``[C]`` or ``[C, M]``): ``(g * onehot(ids) - sum(g) * softmax) / T``,
    the backward's elementwise part, compiled on CUDA (`_chunk_fns`). In-place ops only on tensors
    made here (eager: no more ``[C, V]`` temporaries than before; compiled: never on an input)."""
    z = logits.float() / temperature
    g = g if g.dim() == 2 else g[:, None]  # d lp_m / d z = onehot(id_m) - softmax, summed over m
    ids = ids if ids.dim() == 2 else ids[:, None]
    dz = torch.exp(z - lse[:, None]).mul_(-g.sum(-1, keepdim=True))  # -g * softmax
    dz = _add_onehot(dz, ids, g)  # + g * onehot
    return dz.div_(temperature).to(dtype)  # z = logits / T; autocast's logits were `dtype`


def _add_onehot(dz: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # eager, scatter_add_ is one small pass; traced, a scatter makes Inductor write dz out in
    # float32 first, while a compare against the column index fuses into dz's own kernel
    if torch.compiler.is_compiling():
        return dz + onehot_rows(ids, g, dz.shape[-1])
    return dz.scatter_add_(-1, ids, g)


def onehot_rows(ids: torch.Tensor, g: torch.Tensor, width: int) -> torch.Tensor:
    """``[C, width]``: ``g[c, m]`` summed at column ``ids[c, m]``, zero elsewhere (``scatter_add``
    as a where over the ``[C, width, M]`` broadcast, which Inductor reduces without making it)."""
    cols = torch.arange(width, device=ids.device)
    return torch.where(cols[:, None] == ids[:, None, :], g[:, None, :], 0.0).sum(-1)


def fast_path(device: torch.device) -> bool:
    """Whether the compiled chunk functions and the in-matmul accumulation are taken on ``device``:
    CUDA only (CPU stays eager: no compile in the tests), and `FAST` / ``ASYNCRL_HEAD_FAST``."""
    on = FAST if FAST is not None else os.environ.get("ASYNCRL_HEAD_FAST", "1") != "0"
    return on and device.type == "cuda"


def _chunk_fns(device: torch.device) -> tuple[Callable, Callable]:
    """(`chunk_stats`, `chunk_grad_logits`): compiled where `fast_path`, else themselves."""
    return _compiled() if fast_path(device) else (chunk_stats, chunk_grad_logits)


@functools.cache
def _compiled() -> tuple[Callable, Callable]:
    # dynamic: the last, shorter chunk of every micro-batch (and each new micro-batch length) reuses
    # the one graph instead of compiling a new size; fullgraph: a break would split the fusion
    compile = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    return compile(chunk_stats), compile(chunk_grad_logits)


@functools.cache
def _fp32_matmul(device: torch.device, dtype: torch.dtype) -> str:
    """How ``acc += a @ b`` (``acc`` float32, ``a``, ``b`` of ``dtype``) can skip the product in
    ``dtype`` and its float32 copy here, tried once on a tiny input: ``"addmm"`` (accumulate inside
    the matmul, ``out_dtype`` float32), ``"mm"`` (a float32 product, then the add: ``addmm`` asked
    ``acc`` be of the operands' dtype until pytorch#167931, after 2.9), ``""`` (neither, or not CUDA)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return ""
    a = torch.linspace(-1, 1, 128, device=device).reshape(8, 16).to(dtype)  # no RNG draws
    b = torch.linspace(-2, 1, 128, device=device).reshape(16, 8).to(dtype)
    want = 1 + a.float() @ b.float()
    for mode in ("addmm", "mm"):
        acc = torch.ones(8, 8, device=device)
        try:
            _accumulate_as(mode, acc, a, b)
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if torch.allclose(acc, want, rtol=1e-2, atol=1e-2):
            return mode
    return ""


def _accumulate_as(mode: str, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if mode == "addmm":  # cuBLAS adds into acc in float32 (beta=1): no [V, H] temporary at all
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif mode == "mm":  # one float32 [V, H] temporary, no low-precision one and no cast pass
        acc += torch.mm(a, b, out_dtype=torch.float32)
    else:
        acc += (a @ b).float()


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fast: bool) -> None:
    """``acc += a @ b``, ``acc`` float32: on the fast path without the ``[V, H]`` product in
    ``a``'s dtype and its float32 copy where torch can (`_fp32_matmul`), else as before."""
    _accumulate_as(_fp32_matmul(acc.device, a.dtype) if fast else "", acc, a, b)


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
        fast = fast_path(hidden.device)
        grad_logits = _chunk_fns(hidden.device)[1]
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(dtype)
            logits = F.linear(h, w, b)
            dz = grad_logits(logits, lse[s : s + chunk], grad_lp[s : s + chunk], targets[s : s + chunk], t, dtype)
            del logits  # the [C, V] recompute, before the matmuls make more
            if grad_h is not None:
                grad_h[s : s + chunk] = (dz @ w).to(hidden.dtype)
            if grad_w is not None:
                _accumulate(grad_w, dz.t(), h, fast)
            if grad_b is not None:  # fast: summed in float32 without a float32 copy of dz
                grad_b += dz.sum(0, dtype=torch.float32) if fast else dz.float().sum(0)
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
