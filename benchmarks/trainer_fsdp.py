"""The trainer at world size 1: FSDP2 (``trainer/fsdp.py``, as an N-rank trainer runs it) against
today's plain trainer, on a 0.5B-shaped model (Qwen2.5-0.5B's shape, random weights) and the same
batch: step time, peak device memory of a step, and the peak extra memory of a weight sync's
gathers (one bucket at a time, ``trainer/sharded_sync.py``).

    python benchmarks/trainer_fsdp.py                     # both modes, each in its own process, on cuda
    python benchmarks/trainer_fsdp.py --device cpu --shape tiny --steps 2   # a smoke run anywhere

Prints one line per mode and a comparison, and writes the numbers as JSON (``--out``). Each mode
runs in a fresh process, so its peak memory is its own and the FSDP mode has its own (1-rank)
process group from our rendezvous.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # Qwen2.5-0.5B's shape; a tiny one for a smoke run
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=512,
    ),
}


def write_model(path: str, shape: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump({"prompt_style": "compact", "max_new_tokens_hint": 24}, f)


def make_batch(vocab: int, groups: int, group_size: int, prompt: int, completion: int):
    from asyncrl.rl.rollout import RolloutGroup

    rng = random.Random(0)
    out = []
    for g in range(groups):
        ids = [rng.randrange(vocab) for _ in range(prompt)]
        comps = [
            [rng.randrange(vocab) for _ in range(rng.randint(completion // 2, completion))] for _ in range(group_size)
        ]
        out.append(
            RolloutGroup(
                g,
                ids,
                comps,
                [[-rng.uniform(0.5, 3.0) for _ in c] for c in comps],
                [float(j % 2) for j in range(group_size)],
                version=0,
            )
        )
    return out


def run_mode(args) -> dict:
    """One mode in this process: build the trainer, take ``--steps`` steps, measure."""
    import torch

    from asyncrl.comm.address import SyncAddress
    from asyncrl.comm.layout import sender_layout
    from asyncrl.rl.config.trainer import TrainerConfig
    from asyncrl.rl.trainer.actor import TrainerActor
    from asyncrl.rl.trainer.sharded_sync import GatheredBuckets

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cuda = args.device == "cuda"
    trainer = TrainerActor(args.model, TrainerConfig(micro_batch_tokens=args.micro_batch_tokens), device=args.device)
    if args.mode == "fsdp":
        from asyncrl.comm.rendezvous import reserve_listener
        from asyncrl.rl.trainer.group import RankGroup

        listener = reserve_listener("127.0.0.1")
        address = SyncAddress(
            host="127.0.0.1", port=listener.getsockname()[1], world_size=1, timeout_s=120, name="trainer"
        )
        group = RankGroup.create(address, 0, device=trainer.device, listener=listener)
        from asyncrl.rl.trainer.parallel import Sharded

        # What `rank_join` does on a rank of N, here at one rank (a trainer of world size 1 is built
        # whole, its optimiser with it): the same step, sharded.
        trainer.policy._optimizer = None
        trainer.policy.shard()
        trainer.ranks._parallel = Sharded(group, trainer.device)
    step = trainer.train_share
    batch = make_batch(SHAPES[args.shape]["vocab_size"], args.groups, args.group_size, args.prompt, args.completion)
    times, peaks = [], []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = step(batch)
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    out = {
        "mode": args.mode,
        "device": args.device,
        "shape": args.shape,
        "steps": args.steps,
        "step_s_mean": sum(times) / len(times),
        "step_s_min": min(times),
        "tokens": metrics.tokens,
        "micro_batches": metrics.micro_batches,
        "loss": metrics.loss,
        "params": sum(p.numel() for p in trainer.model.parameters()),
    }
    if cuda:
        out["peak_step_gib"] = max(peaks) / 2**30
    # A weight sync's gathers, bucket by bucket (the sender's two staging buckets come on top).
    params = trainer.policy.weight_tensors()
    layout = sender_layout(params, args.bucket_mib << 20, torch.bfloat16, allow_direct=False)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    source = GatheredBuckets(layout, [params[s.name] for s in layout.tensors])
    source.drain()
    if cuda:
        torch.cuda.synchronize()
        out["sync_gather_extra_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    out["sync_gather_s"] = time.perf_counter() - start
    out["sync_buckets"] = len(layout.buckets)
    out["sync_gathered_peak_gib"] = source.peak_gathered_bytes / 2**30
    trainer.ranks.parallel.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["plain", "fsdp", "both"], default="both")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--completion", type=int, default=384)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--model", default="")
    parser.add_argument("--out", default="trainer_fsdp.json")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    if args.mode != "both":
        print(json.dumps(run_mode(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or os.path.join(tmp, "model")
        if not args.model:
            write_model(model, args.shape)
        results = []
        for mode in ("plain", "fsdp"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode, "--model", model]
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))),
            )
            if done.returncode != 0:
                sys.exit(f"{mode} failed:\n{done.stderr[-4000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for r in results:
        memory = (
            f", peak step {r['peak_step_gib']:.2f} GiB, sync gathers +{r['sync_gather_extra_gib']:.3f} GiB"
            if "peak_step_gib" in r
            else ""
        )
        print(
            f"{r['mode']:5s}: {r['params'] / 1e6:.0f}M params, {r['tokens']:.0f} tokens/step in "
            f"{r['micro_batches']} micro-batches: step {r['step_s_mean']:.3f} s (min {r['step_s_min']:.3f}){memory}; "
            f"sync gathers {r['sync_buckets']} buckets in {r['sync_gather_s']:.3f} s, "
            f"largest gathered {r['sync_gathered_peak_gib']:.3f} GiB; loss {r['loss']:.6f}"
        )
    plain, fsdp = results
    ratio = fsdp["step_s_mean"] / plain["step_s_mean"]
    line = f"fsdp/plain step time {ratio:.3f}x"
    if "peak_step_gib" in plain:
        line += f", peak memory {fsdp['peak_step_gib'] / plain['peak_step_gib']:.3f}x"
    print(line)
    with open(args.out, "w") as f:
        json.dump({"results": results, "step_time_ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
