"""How one trainer runs over its processes: a strategy object, one per trainer.

The trainer actor (``trainer/actor.py``) is written once, over this interface: one train step,
one weight sync, one evaluation, one save, whatever the world size (torchtitan's idea: one train
step over its parallel dimensions, whatever their sizes). What differs between one process and N
lives here, in two strategies:

- `Local`: world size 1, every trainer until it joins a rank group. The policy is whole in this
  process, a call runs on a worker thread, there is nothing to agree on with anyone, and
  checkpoints keep their Hugging Face layout (``trainer/checkpoint.py``).
- `Sharded`: one rank of N (`RankMember.join` swaps it in, once). The policy and its
  optimiser are sharded (FSDP2, ``trainer/fsdp.py``); every call runs inside the rank group's
  guard (``trainer/group.py``); the batch is split by ``trainer/split.py``; the step's metrics are
  summed over the ranks; weights are gathered a bucket at a time for a sync
  (``trainer/sharded_sync.py``); every rank writes its part of a checkpoint (DCP).

World size 1 does not go through FSDP: at one rank it measured a longer step for the same loss
(docs/trainer.md), and its checkpoints would change format.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scoring.batch import MicroBatch
from asyncrl.rl.scoring.logprobs import fused_head_fallback

if TYPE_CHECKING:
    from asyncrl.comm.layout import WeightLayout
    from asyncrl.rl.trainer.group import RankGroup
    from asyncrl.rl.trainer.policy import TrainedPolicy
    from asyncrl.rl.trainer.sharded_sync import GatheredBuckets

T = TypeVar("T")
FAULT_ENV = "ASYNCRL_TEST_TRAINER_FAULT"
"""Test-only: ``<rank>:<step>:raise`` makes that rank raise in the middle of that train step's
backward (after its first micro-batch's backward started the reduce-scatters), ``<rank>:<step>:hang``
makes it stop answering there (saying `FROZEN` on its stderr first, so a test knows when it is
frozen), so a test can inject a failure mid-collective. Never set it in a real run."""
FROZEN = "frozen mid-backward"


class InjectedFault(RuntimeError):
    """Test-only fault raised by `FAULT_ENV`."""


class Local:
    """World size 1: the whole policy in this process."""

    rank = 0
    world_size = 1
    backend = ""

    async def run(self, what: str, deadline_s: float, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn`` off the event loop (``what`` and the deadline name a rank group's call)."""
        return await asyncio.to_thread(fn, *args)

    def share(self, groups: list[RolloutGroup], advantages: torch.Tensor) -> tuple[list[RolloutGroup], torch.Tensor]:
        """This process's part of the batch: all of it."""
        return groups, advantages

    def head_fallback(self, model: torch.nn.Module) -> str:
        """Why ``model`` scores through full logits here ("": the fused head, ``scoring/logprobs.py``)."""
        return fused_head_fallback(model)

    def align(self, batches: list[MicroBatch], model: torch.nn.Module, step: int) -> list[MicroBatch]:
        """The micro-batches this process runs for the step: its own."""
        return batches

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The whole batch's metric sums: this process's."""
        return sums

    def reduce_tally(self, tally: torch.Tensor, sum_columns: int) -> torch.Tensor:
        """The whole batch's tally of the off-policy corrections (``corrections.tally``): this
        process's."""
        return tally

    def clip_grad_norm(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def gathered(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` whole, as this process holds them."""
        return dict(tensors)

    def bucket_source(self, layout: WeightLayout, tensors: Mapping[str, torch.Tensor]) -> GatheredBuckets | None:
        """None: the weight sender reads the parameters in place (its direct path included)."""
        return None

    def agree(self, value: int, what: str) -> None:
        """Nothing to agree on with anyone."""

    def in_step(self, fn: Callable[[], T], seed: int) -> T:
        """``fn`` as it is: no other process runs the same forward passes."""
        return fn()

    def policy_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """None: the model in this process is whole, and saves itself."""
        return None

    def write_checkpoint(self, policy: TrainedPolicy, run_dir: str, step: int, keep: int, run_state: bytes) -> str:
        """``policy``'s checkpoint in the Hugging Face layout
        (``trainer/checkpoint.py``)."""
        from asyncrl.rl.trainer.checkpoint import write_checkpoint

        return write_checkpoint(
            run_dir,
            step,
            keep,
            policy.model,
            policy.tokenizer,
            policy.optimizer,
            policy.steps,
            run_state,
            policy.marker_files(),
        )

    def load_checkpoint(self, policy: TrainedPolicy, path: str) -> int:
        """``policy`` loaded anew from the checkpoint (with LoRA, the start's
        base and the saved adapters), a new optimiser with the saved state; returns its steps."""
        from asyncrl.rl.checkpoint import Checkpoint
        from asyncrl.rl.trainer.checkpoint import load_trainer_state, refuse_sharded

        refuse_sharded(path)
        checkpoint = Checkpoint(-1, path)
        policy.reload(checkpoint.model_dir)
        return load_trainer_state(checkpoint, policy.optimizer)

    def abort_call(self, failed_rank: int, reason: str) -> None:
        """No peers: nothing to leave."""

    def close(self) -> None:
        pass


class Sharded:
    """One rank of an N-rank trainer: ``group`` is its `RankGroup`; the policy is sharded already."""

    def __init__(self, group: RankGroup, device: torch.device):
        self.group, self.device = group, device
        self.rank, self.world_size, self.backend = group.rank, group.world_size, group.backend

    async def run(self, what: str, deadline_s: float, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn`` as one guarded call of the rank group (`RankGroup.run`): a failure on any
        rank, or ``deadline_s``, ends it on every rank."""
        return await asyncio.wrap_future(self.group.run(what, deadline_s, fn, *args))

    def share(self, groups: list[RolloutGroup], advantages: torch.Tensor) -> tuple[list[RolloutGroup], torch.Tensor]:
        """This rank's sequences, balanced by tokens (``trainer/split.py``); the advantages were
        computed over whole groups before."""
        from asyncrl.rl.trainer.split import rank_share

        return rank_share(groups, advantages, self.rank, self.world_size)

    def head_fallback(self, model: torch.nn.Module) -> str:
        """As on one process: the fused head runs inside the sharded root's forward
        (`scoring.forward.in_root_forward`), where FSDP2 has gathered the head and the embeddings."""
        return fused_head_fallback(model)

    def align(self, batches: list[MicroBatch], model: torch.nn.Module, step: int) -> list[MicroBatch]:
        """Each forward and backward runs collectives: every rank takes as many micro-batches as
        the one with the most, the others padded with batches that score nothing."""
        import torch.distributed as dist

        count = torch.tensor([len(batches)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        _arm_fault(model, self.rank, step)
        return batches + [_empty_micro_batch(self.device) for _ in range(int(count) - len(batches))]

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Every rank's share of each (globally normalised) sum, summed: the whole batch's."""
        import torch.distributed as dist

        keys = sorted(sums)
        total = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    def reduce_tally(self, tally: torch.Tensor, sum_columns: int) -> torch.Tensor:
        """Every rank's tally (``corrections.tally``) as one: its first ``sum_columns`` summed, the
        others (maxima) the largest."""
        import torch.distributed as dist

        counts, extremes = tally[:, :sum_columns].contiguous(), tally[:, sum_columns:].contiguous()
        dist.all_reduce(counts)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        return torch.cat([counts, extremes], dim=1)

    def clip_grad_norm(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        from asyncrl.rl.trainer.fsdp import clip_grad_norm

        return clip_grad_norm(params, max_norm)

    def gathered(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` whole on rank 0's CPU, one at a time (every rank gathers each in turn);
        empty on the other ranks."""
        from asyncrl.rl.trainer.fsdp import full_tensor

        out = {}
        for name, t in tensors.items():
            whole = full_tensor(t.detach())
            if self.rank == 0:
                out[name] = whole.cpu()
        return out

    def bucket_source(self, layout: WeightLayout, tensors: Mapping[str, torch.Tensor]) -> GatheredBuckets:
        """The sync's buckets gathered one at a time (``trainer/sharded_sync.py``)."""
        from asyncrl.rl.trainer.sharded_sync import GatheredBuckets

        return GatheredBuckets(layout, [tensors[spec.name] for spec in layout.tensors])

    def agree(self, value: int, what: str) -> None:
        """Raise unless every rank computed the same ``value`` (one all-reduce of ``v, -v``)."""
        import torch.distributed as dist

        both = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if int(both[0]) != -int(both[1]):
            raise RuntimeError(f"trainer rank {self.rank}: the trainer ranks computed different {what}")

    def in_step(self, fn: Callable[[], T], seed: int) -> T:
        """Run ``fn`` with the same RNG state on every rank (a sharded forward runs in step on all
        of them, sampled evaluation included); the training RNG is left as it was."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return fn()

    def policy_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0's CPU (empty on the others), a tensor at a time."""
        from asyncrl.rl.trainer.fsdp import full_state_dict

        return full_state_dict(model)

    def write_checkpoint(self, policy: TrainedPolicy, run_dir: str, step: int, keep: int, run_state: bytes) -> str:
        """Every rank writes its shards of ``policy`` (DCP,
        ``trainer/checkpoint.py``); rank 0 returns the path, the others ""."""
        from asyncrl.rl.trainer.checkpoint import write_sharded_checkpoint

        return write_sharded_checkpoint(
            self.rank, self.world_size, run_dir, step, keep, policy.model, policy.optimizer, policy.steps, run_state
        )

    def load_checkpoint(self, policy: TrainedPolicy, path: str) -> int:
        """The shards loaded into ``policy``'s sharded model and optimiser in
        place (resharded by DCP to this world size); returns its steps."""
        from asyncrl.rl.checkpoint import Checkpoint
        from asyncrl.rl.trainer.checkpoint import load_sharded_checkpoint

        return load_sharded_checkpoint(self.rank, Checkpoint(-1, path), policy.model, policy.optimizer)

    def abort_call(self, failed_rank: int, reason: str) -> None:
        self.group.abort_call(failed_rank, reason)

    def close(self) -> None:
        self.group.close()


def _empty_micro_batch(device: torch.device) -> MicroBatch:
    """Two tokens, nothing scored: a forward and a backward (hence every collective of one) whose
    loss and gradient are exactly zero."""
    zeros = torch.zeros(1, 2, dtype=torch.long, device=device)
    return MicroBatch(
        input_ids=zeros,
        attention=torch.ones_like(zeros),
        score_index=torch.zeros(1, 1, dtype=torch.long, device=device),
        mask=torch.zeros(1, 1, dtype=torch.bool, device=device),
        behaviour=torch.zeros(1, 1, device=device),
        advantages=torch.zeros(1, device=device),
        row=torch.zeros(1, dtype=torch.long, device=device),
        teacher=torch.zeros(1, 1, device=device),
    )


def _arm_fault(model: torch.nn.Module, rank: int, step: int) -> bool:
    """Test-only (`FAULT_ENV`): make the gradient of the middle decoder layer's output raise (or
    hang) on its way back, once: the peers are then inside the same backward's collectives."""
    from asyncrl.rl.trainer.fsdp import decoder_layers

    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return False
    r, s, kind = spec.split(":")
    if int(r) != rank or int(s) != step:
        return False
    layers = decoder_layers(model)
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def fire(grad: torch.Tensor) -> torch.Tensor:
        if kind == "hang":
            print(f"{FAULT_ENV}: rank {rank} {FROZEN} (step {step})", file=sys.stderr, flush=True)
            time.sleep(3600.0)  # a frozen rank: the peers' deadline must end the step
        raise InjectedFault(f"injected fault mid-backward (rank {rank}, step {step}; {FAULT_ENV})")

    def on_forward(module, args, output):
        for h in handles:
            h.remove()
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(fire)

    handles.append(layers[len(layers) // 2].register_forward_hook(on_forward))
    return True
