"""The endpoints that make a trainer actor one rank of an N-rank trainer (``--trainer.world_size``).

`RankMember` is a mixin for the trainer actor, as `SyncMember` is for the weight-sync group: the
driver asks rank 0 for a store address (`rank_listen`), starts every rank's `rank_join` at once
and waits for all under one deadline (the rendezvous contract), and each rank then shards its
policy (`trainer/fsdp.py`) and rebuilds its optimiser over the shards. From then on every call
that runs collectives runs on every rank, inside the group's guard (`run_guarded`), so a failure
on one rank ends the call on all of them within its deadline (see ``trainer/group.py``).

The sharded versions of the trainer's calls live here, next to the guard that runs them; the
trainer actor delegates to them when it has a rank group, and is unchanged when it has none.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from asyncrl.comm.rendezvous import reserve_listener
from asyncrl.comm.weights import SyncStats
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.trainer.batching import MicroBatch, micro_batches
from asyncrl.rl.trainer.group import RankGroup
from asyncrl.rl.trainer.loss import loss_normalizer, step_advantages
from asyncrl.rl.trainer.schedule import learning_rate, set_learning_rate
from asyncrl.rl.trainer.split import batch_counts, rank_share
from asyncrl.runtime.actor import Actor, endpoint

T = TypeVar("T")
FAULT_ENV = "ASYNCRL_TEST_TRAINER_FAULT"
"""Test-only: ``<rank>:<step>:raise`` makes that rank raise in the middle of that train step's
backward (after its first micro-batch's backward started the reduce-scatters), ``<rank>:<step>:hang``
makes it stop answering there, so a test can inject a failure mid-collective. Never set it in a
real run."""


class InjectedFault(RuntimeError):
    """Test-only fault raised by `FAULT_ENV`."""


class RankMember(Actor):
    """Endpoints of one trainer rank. The actor provides ``model``, ``ref``, ``optimizer``,
    ``device``, ``config``, ``micro_batch_tokens``, ``_utilisation`` and ``_accumulate``."""

    ranks: RankGroup | None = None
    _rank_listener: socket.socket | None = None
    last_gathered_bytes = 0
    """Most bytes of whole parameters held at once by the last weight sync's gathers."""

    @endpoint
    async def rank_listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the trainer group's store socket; returns its port."""
        if self._rank_listener is not None:
            self._rank_listener.close()
        self._rank_listener = reserve_listener(host, port)
        return self._rank_listener.getsockname()[1]

    @endpoint
    async def rank_join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60.0) -> str:
        """Join the trainer group, shard the policy over it and rebuild the optimiser over the
        shards. Returns the group's backend. Once only: a group that failed is never rebuilt
        (the run stops and resumes from a checkpoint)."""
        if self.ranks is not None:
            raise RuntimeError(f"trainer rank {rank} is already in a rank group")
        listener, self._rank_listener = (self._rank_listener, None) if rank == 0 else (None, self._rank_listener)

        def join() -> str:
            group = RankGroup.create(host, port, rank, world_size, device=self.device, timeout_s=timeout_s,
                                     listener=listener)
            try:
                self._shard_policy()
            except BaseException:
                group.close()
                raise
            self.ranks = group
            return group.backend

        return await asyncio.to_thread(join)

    @endpoint
    async def abort_call(self, failed_rank: int, reason: str) -> None:
        """The driver saw trainer rank ``failed_rank`` die: leave the collective running now."""
        if self.ranks is not None:
            self.ranks.abort_call(failed_rank, reason)

    @endpoint
    async def gradients(self, deadline_s: float = 0.0) -> dict[str, torch.Tensor]:
        """The last step's gradients, whole (every rank gathers; rank 0 returns them, the others
        an empty dict). For tests and debugging: it holds the whole gradient in this process."""
        from asyncrl.rl.trainer.fsdp import full_tensor

        def gather() -> dict[str, torch.Tensor]:
            out = {}
            for name, p in self.model.named_parameters():
                if p.grad is not None:
                    whole = full_tensor(p.grad).detach().cpu()
                    if self.rank == 0:
                        out[name] = whole
            return out

        if self.ranks is None:
            return await asyncio.to_thread(gather)
        return await self.run_guarded("gathering the gradients", deadline_s, gather)

    @property
    def rank(self) -> int:
        return self.ranks.rank if self.ranks is not None else 0

    async def run_guarded(self, what: str, deadline_s: float, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` as one guarded call of the rank group (`RankGroup.run`)."""
        return await asyncio.wrap_future(self.ranks.run(what, deadline_s or self.config_deadline_s, fn, *args))

    config_deadline_s = 900.0
    """A guarded call's deadline when the driver names none (the default train step deadline)."""

    async def on_stop(self) -> None:
        await super().on_stop()
        if self._rank_listener is not None:
            self._rank_listener.close()
            self._rank_listener = None
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            await asyncio.to_thread(ranks.close)

    # -- the sharded calls (on the worker thread, inside the guard) ------------------------------
    def _shard_policy(self) -> None:
        from asyncrl.rl.trainer.fsdp import shard_model

        cfg = self.config
        shard_model(self.model, self.device, bf16=cfg.bf16, activation_checkpointing=cfg.activation_checkpointing)
        if self.ref is not None:
            shard_model(self.ref, self.device, bf16=cfg.bf16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)

    def _sharded_train_step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One optimiser step of every rank on its share of ``groups`` (``trainer/split.py``):
        every loss divided by the whole batch's count, gradients summed across ranks; the metrics
        of the whole batch (each rank's sums, summed) on every rank."""
        from asyncrl.rl.trainer.fsdp import clip_grad_norm

        start = time.perf_counter()
        cfg, ranks = self.config, self.ranks
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        advantages = step_advantages(groups, cfg.loss, cfg.normalize_std)
        n_tokens, n_seqs = (float(n) for n in batch_counts(groups))
        normalizer = loss_normalizer(cfg.loss, n_tokens, n_seqs)
        share, share_advantages = rank_share(groups, advantages, ranks.rank, ranks.world_size)
        budget = self.micro_batch_tokens()
        batches = micro_batches(share, share_advantages, budget, self.device) if share else []
        # Each forward and backward runs collectives: every rank takes as many micro-batches as
        # the one with the most, the others padded with batches that score nothing.
        count = torch.tensor([len(batches)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        batches += [_empty_micro_batch(self.device) for _ in range(int(count) - len(batches))]
        self.optimizer.zero_grad(set_to_none=True)
        _arm_fault(self.model, ranks.rank, self.steps + 1)
        sums = self._accumulate_all(batches, normalizer, n_tokens)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = clip_grad_norm(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        lr = learning_rate(cfg, self.steps)
        set_learning_rate(self.optimizer, lr)
        self.optimizer.step()
        self.steps += 1
        sums.pop("tokens", None)
        sums.pop("ratio_max", None)
        keys = sorted(sums)
        total = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)  # every rank's share of each (globally normalised) sum
        out = dict(zip(keys, total.tolist()))
        out.update(grad_norm=float(grad_norm), lr=lr, tokens=n_tokens, sequences=n_seqs, micro_batches=int(count),
                   micro_batch_tokens=budget, train_s=time.perf_counter() - start)
        out.update(self._utilisation(groups, out["train_s"]))  # this rank's memory, the group's MFU
        return out


    def _sharded_setup_sender(self, timeout_s: float, bucket_bytes: int, wire_dtype: torch.dtype | None) -> int:
        """Every rank computes the layout from its parameters' global shapes; rank 0 also agrees
        on it with the samplers. The ranks check they computed the same one."""
        from asyncrl.comm.weights import WeightSender, default_bucket_bytes, sender_layout

        params = self.weight_tensors()
        size = bucket_bytes or default_bucket_bytes(self.device)
        if self.rank == 0:
            self.sender = WeightSender.create(self.sync_comm, self.sync_group, params, bucket_bytes=size,
                                              timeout_s=timeout_s, wire_dtype=wire_dtype, allow_direct=False)
            layout = self.sender.layout
        else:
            layout = sender_layout(params, size, wire_dtype, allow_direct=False)
        digest = layout.digest()
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if int(both[0]) != -int(both[1]):
            raise RuntimeError(f"trainer rank {self.rank}: the trainer ranks computed different weight layouts")
        self._layout, self._sync_timeout_s = layout, timeout_s
        return len(layout.buckets)

    async def _sharded_send_weights(self, version: int) -> SyncStats:
        """Rank 0 sends; every rank gathers each bucket in turn (``trainer/sharded_sync.py``). A
        failure on the weight-sync side (a sampler's) is raised after the guard, which only sees
        the trainer group's collectives, all matched: the trainer group survives it."""
        from asyncrl.comm.errors import CommError
        from asyncrl.rl.trainer.sharded_sync import GatheredBuckets

        layout = self._layout
        params = self.weight_tensors()

        def send() -> tuple[SyncStats, BaseException | None]:
            source = GatheredBuckets(layout, [params[spec.name] for spec in layout.tensors])
            none = SyncStats(version, 0, 0, 0.0)  # the ranks > 0 gather only; the driver reads rank 0's
            try:
                if self.rank == 0:
                    return self.sender.send(version, source=source), None
                source.drain()
                return none, None
            except CommError as exc:  # the weight-sync group's, not ours
                return none, exc
            finally:
                source.drain()  # every bucket gathered on every rank, whatever happened
                self.last_gathered_bytes = source.peak_gathered_bytes

        stats, error = await self.run_guarded(f"the weight sync of v{version}", self._sync_timeout_s, send)
        if error is not None:
            raise error
        return stats

    def _in_step_rng(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` with the same RNG state on every rank (a sharded forward runs in step on all
        of them, sampled evaluation included); the training RNG is left as it was."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed * 1_000_003 + self.steps)
            return fn()

    def _sharded_save_checkpoint(self, run_dir: str, step: int, keep: int, run_state: bytes) -> str:
        from asyncrl.rl.trainer.sharded_checkpoint import write_sharded_checkpoint

        return write_sharded_checkpoint(self.rank, self.ranks.world_size, run_dir, step, keep, self.model,
                                        self.optimizer, self.steps, run_state)

    def _sharded_load_checkpoint(self, path: str) -> int:
        from asyncrl.rl.checkpoint import Checkpoint
        from asyncrl.rl.trainer.sharded_checkpoint import load_sharded_checkpoint

        self.steps = load_sharded_checkpoint(self.rank, Checkpoint(-1, path), self.model, self.optimizer)
        self.sender = None  # set up again with the weight-sync group
        return self.steps

    def _sharded_digest(self) -> str:
        from asyncrl.rl.digest import tensor_digest
        from asyncrl.rl.trainer.fsdp import full_state_dict

        whole = full_state_dict(self.model)
        if self.rank != 0:
            return ""
        return tensor_digest({name: whole[name] for name, _ in self.model.named_parameters()})

    def _sharded_save(self, final: str, extra_files: dict[str, str]) -> str:
        from asyncrl.rl.trainer.fsdp import full_state_dict

        whole = full_state_dict(self.model)
        if self.rank != 0:
            return ""
        return self._save(final, extra_files, state_dict=whole)


def _empty_micro_batch(device: torch.device) -> MicroBatch:
    """Two tokens, nothing scored: a forward and a backward (hence every collective of one) whose
    loss and gradient are exactly zero."""
    zeros = torch.zeros(1, 2, dtype=torch.long, device=device)
    return MicroBatch(input_ids=zeros, attention=torch.ones_like(zeros),
                      score_index=torch.zeros(1, 1, dtype=torch.long, device=device),
                      mask=torch.zeros(1, 1, dtype=torch.bool, device=device),
                      behaviour=torch.zeros(1, 1, device=device), advantages=torch.zeros(1, device=device),
                      teacher=torch.zeros(1, 1, device=device))


def _arm_fault(model: torch.nn.Module, rank: int, step: int) -> bool:
    """Test-only (`FAULT_ENV`): make the gradient of the middle decoder layer's output raise (or
    hang) on its way back, once: the peers are then inside the same backward's collectives."""
    import os

    from asyncrl.rl.trainer.fsdp import decoder_layers

    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return False
    r, s, kind = spec.split(":")
    if int(r) != rank or int(s) != step:
        return False
    layers = decoder_layers(model)
    handles = []

    def fire(grad: torch.Tensor) -> torch.Tensor:
        if kind == "hang":
            time.sleep(3600.0)  # a frozen rank: the peers' deadline must end the step
        raise InjectedFault(f"injected fault mid-backward (rank {rank}, step {step}; {FAULT_ENV})")

    def on_forward(module, args, output):
        for h in handles:
            h.remove()
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(fire)

    handles.append(layers[len(layers) // 2].register_forward_hook(on_forward))
    return True
