"""The trainer at 1 and N ranks on real GPUs: step time, tokens/s and peak memory of the same GRPO
step, through the trainer's public endpoints (rank 0 reports), as a run spawns them.

    python benchmarks/trainer_ranks.py --shape 0.5b --world-sizes 1,2      # two GPUs
    python benchmarks/trainer_ranks.py --shape 1.5b --world-sizes 1,2 --micro-batch-tokens 8192
    python benchmarks/trainer_ranks.py --shape embedded --device cpu --completion 32   # a smoke run (gloo)

World size 1 is the plain trainer (one process, unsharded; compiled layers off here so both rows
run the same kernels, ``--compile`` to turn them on for it); N > 1 is FSDP2 over N GPUs with NCCL
(`spawn_trainer_ranks`, as ``--trainer.world_size N`` spawns it), each rank taking a share of the
batch balanced by tokens. A step is ``--prompts`` groups of ``--group-size`` completions of
``--completion`` tokens after a ~60-token prompt, on a random Qwen2 of the shape
(`sampler_backends.make_model`). The first ``--warmup`` steps are left out; the table shows the
median of the rest and rank 0's peak memory over every step (AdamW's state included)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sampler_backends import SHAPES, make_model  # noqa: E402
from trainer_memory import make_batch  # noqa: E402


async def measure(path: str, world_size: int, args) -> dict:
    from asyncrl.rl.config.trainer import TrainerConfig
    from asyncrl.rl.driver.fleet.trainer_ranks import spawn_trainer_ranks
    from asyncrl.rl.trainer.actor import TrainerActor
    from asyncrl.runtime.supervisor import Supervisor

    config = TrainerConfig(
        micro_batch_tokens=args.micro_batch_tokens,
        lr=1e-6,
        temperature=1.0,
        compile=bool(args.compile and world_size == 1),
        world_size=world_size,
    )
    batch = make_batch(args.prompts, args.group_size, args.completion, SHAPES[args.shape][-1] or 256)
    gpus = int(args.device == "cuda")
    kwargs = {"device": args.device}  # the trainer computes on the CPU unless told
    async with Supervisor(call_timeout_s=900, device_kind="cuda" if gpus else "auto") as sup:
        if world_size == 1:
            trainer = await sup.spawn(TrainerActor, path, config, name="trainer", gpus=gpus, kwargs=kwargs)
        else:
            trainer = await spawn_trainer_ranks(
                sup, path, config, timeout_s=300.0, gpus=gpus, env={}, options=kwargs, host="127.0.0.1"
            )
        times, peaks, metrics = [], [], None
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            metrics = await trainer.with_timeout(900).train_step(batch)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
            peaks.append(metrics.peak_mem_gib or 0.0)
    step = statistics.median(times)
    return {
        "world_size": world_size,
        "step_s": step,
        "tokens_per_s": metrics.tokens / step,
        "micro_batches": metrics.micro_batches,
        "micro_batch_tokens": metrics.micro_batch_tokens,
        "mfu": metrics.mfu,
        "peak_gib": max(peaks),
        "loss": metrics.loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="embedded: a CPU smoke run")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="0: auto")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compiled layers at world size 1")
    parser.add_argument("--model-dir", default="", help="where the random model is (made if missing)")
    args = parser.parse_args()
    path = args.model_dir or os.path.join(tempfile.mkdtemp(prefix="ranks-"), args.shape)
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model(path, SHAPES[args.shape], "bfloat16")
    rows = []
    for n in (int(x) for x in args.world_sizes.split(",")):
        r = asyncio.run(measure(path, n, args))
        rows.append(r)
        print(r, flush=True)
    print(f"\n{args.shape}, {args.prompts} x {args.group_size} x {args.completion} a step")
    print("| ranks | step s | tokens/s | micro-batches (tokens) | MFU a GPU | rank 0 peak GiB | loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        print(
            f"| {r['world_size']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['micro_batches']:.0f} "
            f"({r['micro_batch_tokens']:.0f}) | {mfu} | {r['peak_gib']:.1f} | {r['loss']:.5f} |"
        )
    if len(rows) > 1:
        print(f"speed-up at {rows[-1]['world_size']} ranks: {rows[0]['step_s'] / rows[-1]['step_s']:.2f}x")


if __name__ == "__main__":
    main()
