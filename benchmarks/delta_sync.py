"""Delta syncs against full ones on the embedded model (issue 50): bytes a sync, its time, and the
fraction of values a train step changes, at the trainer's default learning rate.

    python benchmarks/delta_sync.py                 # CPU, gloo: fp32 and bf16 on the wire
    python benchmarks/delta_sync.py --steps 30 --wire bfloat16 --lr 1e-6   # an LLM's learning rate

The trainer actor holds the default embedded model (``ModelConfig()``: 4 layers, 128 wide), freshly
initialised (the warm start is skipped: its weights have the same scale), and takes AdamW steps on
synthetic GRPO batches (random completions, rewards 0 or 1, so the advantages are not all zero).
After each step it syncs to one receiver actor that holds the weights in the wire's dtype (fp32:
what the CPU run's HF sampler holds; bf16: what a bf16 engine holds). Each (wire dtype, mode) pair
is its own group, trained from the same seed, so full and delta see the same updates. Times are
the trainer's `SyncStats.seconds`; the table shows medians over the steps after the first (which
is full in both modes).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile

import torch

from asyncrl import Supervisor, endpoint
from asyncrl.comm.layout import DTYPES
from asyncrl.comm.member import SyncMember, form_group
from asyncrl.comm.weights import WeightReceiver


class Holder(SyncMember):
    """A receiver whose weights are tensors of the layout's names, shapes and dtypes."""

    def __init__(self) -> None:
        self.receiver: WeightReceiver | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    @endpoint
    async def setup(self, timeout_s: float = 60.0) -> int:
        self.receiver = await asyncio.to_thread(
            WeightReceiver.create, self.sync_comm, self.sync_group, timeout_s=timeout_s
        )
        self.tensors = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in self.receiver.layout.tensors}
        return len(self.receiver.layout.buckets)

    @endpoint
    async def receive(self, version: int) -> int:
        stats = await asyncio.to_thread(self.receiver.receive, version, self.tensors)
        return stats.sent_bytes


def make_model(path: str) -> None:
    from asyncrl.rl.config.model import ModelConfig
    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.model.warm_start import new_model

    tok = build_tokenizer()
    torch.manual_seed(0)
    new_model(ModelConfig(), tok).save_pretrained(path)
    tok.save_pretrained(path)
    with open(f"{path}/{MARKER_FILE}", "w") as f:
        f.write('{"prompt_style": "compact", "max_new_tokens_hint": 20}')


def batch(step: int, groups: int = 8, group_size: int = 4):
    from asyncrl.rl.rollout import RolloutGroup

    rng = random.Random(step)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randrange(4, 12))]
        completions = [[rng.randrange(3, 40) for _ in range(rng.randrange(4, 20))] for _ in range(group_size)]
        lps = [[-rng.uniform(0.5, 3.0) for _ in c] for c in completions]
        rewards = [float(i % 2) for i in range(group_size)]  # never uniform: every group teaches
        out.append(RolloutGroup(g, prompt, completions, lps, rewards, version=step - 1))
    return out


async def one_run(sup, path: str, wire: str, delta: bool, steps: int, lr: float) -> dict[str, float]:
    from asyncrl.rl.config.trainer import TrainerConfig
    from asyncrl.rl.trainer.actor import TrainerActor

    env = {"OMP_NUM_THREADS": "1"}
    name = f"{wire}-{'delta' if delta else 'full'}"
    trainer, holder = await asyncio.gather(
        sup.spawn(TrainerActor, path, TrainerConfig(lr=lr) if lr else TrainerConfig(), name=f"trainer-{name}", env=env),
        sup.spawn(Holder, name=f"holder-{name}", env=env),
    )
    await form_group([trainer, holder], "127.0.0.1", timeout_s=60)
    wire_dtype = "" if wire == "float32" else wire
    await asyncio.gather(trainer.setup_sender(60, wire_dtype=wire_dtype, delta=delta), holder.setup())
    rows = []
    for version in range(steps + 1):
        if version:
            await trainer.train_step(batch(version))
        sent, _ = await asyncio.gather(trainer.send_weights(version), holder.receive(version))
        rows.append(sent)
    later = rows[1:]
    return {
        "bytes": statistics.median(s.sent_bytes for s in later),
        "tensor_bytes": later[0].bytes,
        "ms": statistics.median(s.seconds for s in later) * 1e3,
        "changed": statistics.median(s.changed for s in later) if delta else float("nan"),
        "delta": sum(s.delta for s in later),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--wire", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--lr", type=float, default=0.0, help="AdamW's learning rate (default: the trainer's)")
    args = parser.parse_args()
    from asyncrl.rl.config.trainer import TrainerConfig

    lr = args.lr or TrainerConfig().lr
    wires = ["float32", "bfloat16"] if args.wire == "both" else [args.wire]
    assert all(w in DTYPES for w in wires)
    with tempfile.TemporaryDirectory() as path:
        make_model(path)
        results = {}
        async with Supervisor(call_timeout_s=300) as sup:
            for wire in wires:
                for delta in (False, True):
                    results[(wire, delta)] = await one_run(sup, path, wire, delta, args.steps, lr)
    print(f"\nembedded model (ModelConfig()), lr {lr:g}, {args.steps} steps, one receiver, gloo on CPU; medians")
    print("| wire | mode | bytes a sync | sync ms (trainer) | values changed a step | delta syncs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (wire, delta), r in results.items():
        changed = f"{r['changed'] * 100:.2f}%" if delta else "-"
        print(
            f"| {wire} | {'delta' if delta else 'full'} | {r['bytes']:,.0f} (tensors {r['tensor_bytes']:,}) "
            f"| {r['ms']:.2f} | {changed} | {r['delta']}/{args.steps} |"
        )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
