"""The trainer's step on a real model shape: peak memory, time and MFU with the fused output layer
(the default) against full logits, at a given or the automatic micro-batch, compiled or not.

    python benchmarks/trainer_memory.py --shape 0.5b                          # one GPU, trainer alone
    python benchmarks/trainer_memory.py --shape 1.5b --micro-batch-tokens 0,16384
    python benchmarks/trainer_memory.py --shape 7b --lora-rank 16 --paths fused
    python benchmarks/trainer_memory.py --shape 0.5b --micro-batch-tokens 0 --paths fused --compile both --profile
    python benchmarks/trainer_memory.py --shape 1.5b --completion 16384 --prompts 2 --group-size 8 \
        --micro-batch-tokens 0 --paths fused --compile auto --reserve-share 0.3   # long sequences, a run's defaults

A step is the trainer's whole ``train_share`` (micro-batching, forward, backward, AdamW) on
``--prompts`` groups of ``--group-size`` completions of ``--completion`` tokens after a Countdown
prompt (~60 tokens): GRPO's default step on a real model. The model is a random Qwen2 of the shape
(`sampler_backends.make_model`), loaded as the trainer loads it (fp32 parameters, bf16 autocast;
LoRA: a bf16 base). ``full`` forces the full-logits path the trainer keeps as its fallback. The
first ``--warmup`` steps are left out; the table shows the median of the rest, and the peak memory
torch allocated over every step, AdamW's state included. The trainer is alone on its GPU here (a
colocated vLLM takes 30% of it in a GRPO run, and auto then picks smaller micro-batches), unless
``--reserve-share`` holds that share of the GPU's memory for the whole run, as such an engine
would. The model has room for the prompt and ``--completion`` tokens; ``--compile auto`` is a
GRPO run's default (on for one trainer process on a GPU), as activation checkpointing's auto is:
on where a sequence is longer than a micro-batch holds without it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sampler_backends import SHAPES, make_model  # noqa: E402


def make_batch(prompts: int, group_size: int, completion: int, vocab: int):
    from asyncrl.rl.rollout import RolloutGroup

    rng = random.Random(0)
    groups = []
    for g in range(prompts):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(50, 70))]
        completions = [[rng.randrange(3, vocab) for _ in range(completion)] for _ in range(group_size)]
        lps = [[-rng.uniform(0.1, 3.0) for _ in c] for c in completions]
        rewards = [float(rng.random() < 0.5) for _ in completions]
        groups.append(RolloutGroup(g, prompt, completions, lps, rewards, version=0))
    return groups


def run(
    path: str,
    batch,
    *,
    device: str,
    path_kind: str,
    tokens: int,
    lora_rank: int,
    steps: int,
    warmup: int,
    compile_layers: bool | None = False,
    pack_tokens: int = 0,
    profile: bool = False,
) -> dict:
    import torch

    from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig
    from asyncrl.rl.trainer.actor import TrainerActor

    lora = LoRAConfig(rank=lora_rank, alpha=2 * max(lora_rank, 1), bf16_base=bool(lora_rank))
    config = TrainerConfig(
        micro_batch_tokens=tokens, temperature=1.0, lr=1e-6, lora=lora, compile=compile_layers, pack_tokens=pack_tokens
    )
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = TrainerActor(path, config, device=device)
    if path_kind == "full":
        trainer.fallback_reason = lambda: "benchmark: full logits"
    times, metrics, error = [], None, ""
    try:
        for i in range(warmup + steps):
            metrics = trainer.train_share(batch)
            if i >= warmup:
                times.append(metrics.train_s)
        if profile and times:
            print_profile(functools.partial(trainer.train_share, batch), cuda)
    except Exception as exc:  # a configuration that does not fit is a row, not the end of the table
        error = str(exc).splitlines()[0][:100]
    row = {
        "path": path_kind,
        "micro_batch_tokens": int(metrics.micro_batch_tokens if metrics is not None else tokens),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "error": error,
    }
    if times and metrics is not None:
        row.update(
            step_s=statistics.median(times),
            micro_batches=int(metrics.micro_batches),
            loss=metrics.loss,
            mfu=metrics.mfu or 0.0,
        )
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def print_profile(step, cuda: bool, rows: int = 25) -> None:
    """One more step under torch's profiler: the ops that took the device's time (the table's
    footer: the device's total, against the step's wall time printed first)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"# profile: step {wall:.3f} s under the profiler")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="embedded: a CPU smoke run")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--paths", default="fused,full", help="fused, full or both")
    parser.add_argument("--micro-batch-tokens", default="0,16384", help="budgets to try (0: auto)")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model-dir", default="", help="where the random model is (made if missing)")
    parser.add_argument("--compile", default="off", help="--trainer.compile: off, on, both or auto")
    parser.add_argument(
        "--reserve-share",
        type=float,
        default=0.0,
        help="hold this share of the GPU's memory, as a colocated vLLM would",
    )
    parser.add_argument("--pack-tokens", type=int, default=0, help="--trainer.pack_tokens")
    parser.add_argument("--profile", action="store_true", help="one more step under torch's profiler, per row")
    args = parser.parse_args()

    path = args.model_dir or tempfile.mkdtemp(prefix=f"asyncrl-{args.shape}-")
    positions = max(1024, 1 << (args.completion + 128 - 1).bit_length())  # the prompt's ~60 tokens too
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model(path, SHAPES[args.shape], "bfloat16", positions)
    batch = make_batch(args.prompts, args.group_size, args.completion, SHAPES[args.shape][5] or 100)
    compiles = {"off": [False], "on": [True], "both": [False, True], "auto": [None]}[args.compile]
    held = None
    if args.reserve_share and args.device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        held = torch.empty(int(total * args.reserve_share), dtype=torch.uint8, device="cuda")  # noqa: F841
    rows = [
        dict(
            run(
                path,
                batch,
                device=args.device,
                path_kind=kind,
                tokens=int(t),
                lora_rank=args.lora_rank,
                steps=args.steps,
                warmup=args.warmup,
                compile_layers=c,
                pack_tokens=args.pack_tokens,
                profile=args.profile,
            ),
            compile=c,
        )
        for t in args.micro_batch_tokens.split(",")
        for kind in args.paths.split(",")
        for c in compiles
    ]
    trained = f"LoRA r{args.lora_rank}, bf16 base" if args.lora_rank else "every parameter (fp32 + AdamW)"
    print(f"# {args.shape}, {trained}; {args.prompts} x {args.group_size} x {args.completion} a step")
    print(f"# pack_tokens {args.pack_tokens}; {args.reserve_share:.0%} of the GPU held aside")
    print("| path | compile | micro_batch_tokens | micro-batches | step s | MFU | peak GiB | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        compiled = "auto" if r["compile"] is None else "on" if r["compile"] else "off"
        head = f"| {r['path']} | {compiled} | {r['micro_batch_tokens']} |"
        if "step_s" not in r:
            print(f"{head} failed: {r['error']} | | | {r['peak_gib']:.1f} | |")
            continue
        print(
            f"{head} {r['micro_batches']} | {r['step_s']:.3f} | "
            f"{100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | {r['loss']:.6f} |"
        )


if __name__ == "__main__":
    main()
