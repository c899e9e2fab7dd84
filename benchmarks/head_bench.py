"""The fused output layer alone (``asyncrl/rl/scoring/chunked_head.py``): forward + backward of
`head_logprobs` with its CUDA fast path off (``ASYNCRL_HEAD_FAST=0``: eager chunk functions, the
``[V, H]`` product cast and added per chunk) and on (compiled chunk functions, float32
accumulation inside ``addmm``), in one process, and how far apart the two land.

    python benchmarks/head_bench.py                            # one GPU, Qwen2-0.5B's head
    python benchmarks/head_bench.py --shape 1.5b
    python benchmarks/head_bench.py --device cpu --tokens 512  # smoke test (both paths eager)

Random bf16 hidden states ``[--tokens, H]`` and head weight ``[V, H]`` (both wanting gradients),
random targets and upstream gradient, temperature 0.7, compute dtype bf16, the default chunk. Each
path runs ``--warmup`` untimed calls (the first compiles) and ``--reps`` timed ones
(``torch.cuda.synchronize`` around each); the table shows the median and the peak memory torch
allocated over the timed calls, then the largest absolute differences of the log-probs and of the
two gradients between the paths (bf16 matmuls: expect differences of the order of bf16 rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's asyncrl

SHAPES = {"0.5b": (896, 151936), "1.5b": (1536, 151936)}  # hidden size, vocabulary


def timed_path(inputs, fast: bool, *, warmup: int, reps: int, temperature: float):
    """(median ms, peak MiB or None, log-probs, grad of hidden, grad of weight) with `FAST` = ``fast``."""
    import torch

    from asyncrl.rl.scoring import chunked_head

    hidden, weight, targets, upstream = inputs
    cuda = hidden.device.type == "cuda"

    def call():
        lp, _ = chunked_head.head_logprobs(hidden, weight, None, targets, temperature, compute_dtype=torch.bfloat16)
        grads = torch.autograd.grad(lp, (hidden, weight), grad_outputs=upstream)
        return lp.detach(), *grads

    chunked_head.FAST = fast
    try:
        for _ in range(warmup):
            out = call()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            out = call()
            if cuda:
                torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
    finally:
        chunked_head.FAST = None
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return (statistics.median(times), peak, *out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls a path (the first compiles)")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()

    import torch

    from asyncrl.rl.scoring import chunked_head

    width, vocab = SHAPES[args.shape]
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, width, device=device, generator=gen).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(vocab, width, device=device, generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (args.tokens,), device=device, generator=gen)
    upstream = torch.randn(args.tokens, device=device, generator=gen)
    inputs = (hidden, weight, targets, upstream)

    print(
        f"# {args.shape}: tokens {args.tokens}, hidden {width}, vocab {vocab}, "
        f"chunk {chunked_head.chunk_tokens(vocab)} tokens, {args.device}, torch {torch.__version__}"
    )
    rows = {}
    for name, fast in (("eager", False), ("fast", True)):
        rows[name] = timed_path(inputs, fast, warmup=args.warmup, reps=args.reps, temperature=args.temperature)
    taken = chunked_head.fast_path(device)
    print(f"{'path':<8}{'median ms':>12}{'peak MiB':>12}")
    for name, (ms, peak, *_) in rows.items():
        label = name if name == "eager" or taken else "fast*"
        print(f"{label:<8}{ms:>12.1f}{'-' if peak is None else f'{peak:.0f}':>12}")
    if not taken:
        print("# fast*: the fast path is CUDA only; both rows ran eager")
    else:
        print(f"# grad_w float32 accumulation (fast path): {chunked_head._fp32_matmul(device, torch.bfloat16) or None}")
    (_, _, *old), (_, _, *new) = rows["eager"], rows["fast"]
    for what, a, b in zip(("log-probs", "grad hidden", "grad weight"), old, new):
        diff = (a.float() - b.float()).abs().max().item()
        print(f"max |diff| {what:<12}{diff:.3e}   (max |eager| {a.float().abs().max().item():.3e})")


if __name__ == "__main__":
    main()
