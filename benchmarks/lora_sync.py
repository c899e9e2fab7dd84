"""Bytes and time of one weight sync with LoRA: merged (base + B·A·alpha/rank under the base
model's names, to any sampler backend) against adapter-only (the A and B matrices; HF samplers).

    python benchmarks/lora_sync.py --shape tiny --ranks 16,64          # CPU, gloo (this machine)
    python benchmarks/lora_sync.py --shape 0.5b --ranks 16,64          # CPU, gloo, Qwen2-0.5B's shape
    python benchmarks/lora_sync.py --shape 0.5b --ranks 16,64 --device cuda   # two GPUs, NCCL
    python benchmarks/lora_sync.py --shape 0.5b --ranks 16,64 --device cuda --colocate   # one GPU, CUDA IPC

A real trainer actor (LoRA on every linear module of every layer) and a real HF sampler actor,
in processes of their own, in one weight-sync group. A "sync" is the trainer's ``send_weights``
(for merged: refreshing the merged buffers, then the bucketed broadcast) together with the
sampler's ``receive_weights``, timed from the driver: median of ``--iters`` after one warm-up.
"full" is the same model fully fine-tuned (no LoRA), for reference. Bytes are the layout's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

from asyncrl import Supervisor


def sync_bytes(path: str, lora) -> int:
    """Bytes one sync moves: those of the tensors the trainer sends (the layout's total)."""
    import torch

    from asyncrl.rl.model.policy import load_policy
    from asyncrl.rl.trainer.lora import MergedWeights, lora_policy, sync_tensors

    model, _, _ = load_policy(path)
    if not lora.rank:
        return sum(p.nbytes for p in model.parameters())
    model = lora_policy(model, lora, torch.device("cpu"))
    merged = MergedWeights(model) if lora.sync == "merged" else None
    return sum(t.nbytes for t in sync_tensors(model, lora.sync, merged).values())


async def measure(path: str, mode: str, rank: int, device: str, iters: int, colocate: bool) -> dict:
    from asyncrl.comm.member import form_group
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.trainer.actor import TrainerActor

    lora = LoRAConfig(rank=rank, alpha=2 * rank, sync=mode) if mode != "full" else LoRAConfig()
    env = {"OMP_NUM_THREADS": "1"} if device == "cpu" else {}
    gpus = 1 if device == "cuda" else 0
    # colocated: the sampler on the trainer's GPU, weights as CUDA IPC handles (how one GPU runs)
    placement = {"share_devices_with": "trainer"} if colocate else {"gpus": gpus}
    async with Supervisor(call_timeout_s=600) as sup:
        trainer = await sup.spawn(
            TrainerActor, path, TrainerConfig(lora=lora), name="trainer", env=env, gpus=gpus, kwargs={"device": device}
        )
        sampler = await sup.spawn(
            SamplerActor,
            path,
            SamplerConfig(backend="hf"),
            name="sampler",
            env=env,
            **placement,
            kwargs={
                "device": device,
                "data": DataConfig(n_train=10, n_heldout=8),
                "adapter": lora if mode == "adapter" else None,
            },
        )
        await form_group([trainer, sampler], "127.0.0.1", timeout_s=120, backend="ipc" if colocate else "auto")
        await asyncio.gather(trainer.setup_sender(120), sampler.setup_receiver(120))
        times = []
        for version in range(1, iters + 2):
            start = time.perf_counter()
            await asyncio.gather(trainer.send_weights(version), sampler.receive_weights(version))
            times.append(time.perf_counter() - start)
        same = await trainer.weights_digest() == await sampler.weights_digest()
    nbytes = sync_bytes(path, lora)
    return {"mode": mode, "rank": rank, "bytes": nbytes, "sync_s": statistics.median(times[1:]), "bit_exact": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "0.5b"])
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--colocate", action="store_true", help="cuda: both on one GPU, weights over CUDA IPC")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from packing import write_model  # the same model shapes as the packing benchmark

    rows = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-lora-sync-") as path:
        write_model(path, args.shape)
        rows.append(asyncio.run(measure(path, "full", 0, args.device, args.iters, args.colocate)))
        for rank in [int(r) for r in args.ranks.split(",")]:
            for mode in ("merged", "adapter"):
                rows.append(asyncio.run(measure(path, mode, rank, args.device, args.iters, args.colocate)))
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return
    where = f"{args.device}, colocated over CUDA IPC" if args.colocate else args.device
    print(f"# {args.shape} on {where}, median of {args.iters} syncs (trainer send + sampler receive)")
    print("| sync | rank | bytes | MiB | sync s | bit-exact |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['rank'] or '-'} | {r['bytes']} | {r['bytes'] / 2**20:.2f} | {r['sync_s']:.4f} | "
            f"{r['bit_exact']} |"
        )


if __name__ == "__main__":
    main()
