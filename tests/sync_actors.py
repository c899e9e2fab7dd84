"""Actors for the weight-sync tests: a sender and a receiver of a deterministic, mixed-dtype
state dict, each a `SyncMember` so the driver can put them in a group."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time

import torch

from asyncrl import endpoint
from asyncrl.comm.member import SyncMember
from asyncrl.comm.weights import WeightReceiver, WeightSender


def make_state(
    seed: int, *, big: int = 70_000, tiny: int = 40, shape_of_w: tuple[int, int] = (33, 7)
) -> dict[str, torch.Tensor]:
    """fp32, bf16, fp16 and int64 tensors; two larger than a 64 KiB bucket; many tiny; one empty."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(big, generator=g),  # 280 kB: chunked across buckets
        "w.bf16": torch.randn(shape_of_w, generator=g).bfloat16(),
        "w.fp16": torch.randn(17, 3, generator=g).half(),
        "steps.int64": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(float(seed)),
    }
    for i in range(tiny):
        state[f"tiny.{i}"] = torch.randn(i % 5 + 1, generator=g)
    state["head.weight"] = torch.randn(big // 4, generator=g)  # 70 kB
    return state


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_gloo_members(world: int, member, timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
    """``member(rank, group, comm)`` on ``world`` threads over one store and gloo; raises what any
    of them raised, and fails if one is still running after ``timeout_s``."""
    from asyncrl.comm.gloo import GlooCommunicator
    from asyncrl.comm.rendezvous import StoreGroup, reserve_listener

    listener = reserve_listener(host)
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            group = StoreGroup.create(host, port, rank, world, 10, listener=listener if rank == 0 else None)
            comm = GlooCommunicator.create(group, 10)
            try:
                member(rank, group, comm)
            finally:
                comm.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"a member was still running after {timeout_s:g} s"


class Sender(SyncMember):
    def __init__(self, seed: int = 0, *, device: str = "cpu"):
        self.state = {k: v.to(device) for k, v in make_state(seed).items()}
        self.sender: WeightSender | None = None
        self.delta_syncs = 0

    @endpoint
    async def setup(
        self, bucket_bytes: int = 64 << 10, timeout_s: float = 20.0, delta: bool = False
    ) -> tuple[int, int]:
        """Returns (buckets, tensors sent directly)."""
        self.sender = await asyncio.to_thread(
            WeightSender.create,
            self.sync_comm,
            self.sync_group,
            self.state,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            delta=delta,
        )
        return len(self.sender.layout.buckets), len(self.sender.layout.direct)

    @endpoint
    async def step_and_send(self, version: int, small: bool = False, every: int = 1) -> str:
        """Change every tensor (as an optimizer step would, in place), then sync it as ``version``;
        ``small``: change one element of each (a delta sync's case); ``every``: every k-th element."""
        for t in self.state.values():
            if t.numel():
                (t.view(-1)[:1] if small else t.view(-1)[::every]).add_(1)
        stats = await asyncio.to_thread(self.sender.send, version)
        self.delta_syncs += stats.delta
        return digest(self.state)

    @endpoint
    async def deltas(self) -> int:
        """How many of this sender's syncs went as deltas."""
        return self.delta_syncs


class Receiver(SyncMember):
    def __init__(
        self,
        seed: int = 99,
        *,
        whole: bool = False,
        slow_s: float = 0.0,
        shape_of_w: tuple[int, int] = (33, 7),
        device: str = "cpu",
        bf16_checkpoint: str = "",
    ):
        """``bf16_checkpoint``: hold that checkpoint's parameters cast to bf16 instead (a sampler's
        weights as a GPU vLLM engine holds them)."""
        if bf16_checkpoint:
            from safetensors.torch import load_file  # the checkpoint's tensors, without transformers' import

            held = {n: t.bfloat16() for n, t in load_file(os.path.join(bf16_checkpoint, "model.safetensors")).items()}
        else:  # different values from the sender's, same layout
            held = make_state(seed, shape_of_w=shape_of_w)
        self.state = {k: v.to(device) for k, v in held.items()}
        self.whole = whole  # hand whole tensors to a callable instead of copying in place
        self.slow_s = slow_s  # per-tensor delay in the consumer, so a test can kill us mid-sync
        self.receiver: WeightReceiver | None = None
        self.delta_syncs = 0
        self.syncs = 0
        self.stager = None

    @endpoint
    async def setup(self, timeout_s: float = 20.0, notices: bool = False) -> tuple[int, int]:
        self.receiver = await asyncio.to_thread(
            WeightReceiver.create,
            self.sync_comm,
            self.sync_group,
            expect=self.state,
            timeout_s=timeout_s,
            notices=notices,
        )
        return len(self.receiver.layout.buckets), len(self.receiver.layout.direct)

    @endpoint
    async def receive(self, version: int) -> str:
        into = self._consume if (self.whole or self.slow_s) else self.state
        self.syncs += 1
        stats = await asyncio.to_thread(self.receiver.receive, version, into)
        self.delta_syncs += stats.delta
        return digest(self.state)

    @endpoint
    async def stage(self) -> None:
        """Take every later sync beside the weights (`StagedReceiver`), as a vLLM worker does."""
        from asyncrl.comm.staged import StagedReceiver
        from asyncrl.comm.sync_notice import NoticeWatch

        watch = NoticeWatch(self.sync_group, self.receiver.setup_calls)
        self.stager = StagedReceiver(self.receiver, self.state, watch, first=self.syncs)

    @endpoint
    async def apply(self, version: int) -> tuple[str, str]:
        """Apply staged sync ``version``: the weights' digests before and after."""
        before = digest(self.state)
        stats = await asyncio.to_thread(self.stager.apply, version, 30.0)
        self.delta_syncs += stats.delta
        return before, digest(self.state)

    async def on_stop(self) -> None:
        if self.stager is not None:
            self.stager.stop()
        await super().on_stop()

    @endpoint
    async def deltas(self) -> int:
        """How many of this receiver's syncs came as deltas."""
        return self.delta_syncs

    @endpoint
    async def weights_digest(self) -> str:
        """The digest the samplers give of their weights (`--run.check_weights`)."""
        from asyncrl.rl.digest import tensor_digest

        return tensor_digest(self.state)

    @endpoint
    async def mapped(self) -> int:
        return mapped_allocations(self)

    def _consume(self, name: str, tensor: torch.Tensor) -> None:
        if self.slow_s:
            time.sleep(self.slow_s)
        self.state[name].copy_(tensor)


class NcclProbe(SyncMember):
    """Raw collectives on the group's communicator next to torch.distributed's, for the GPU tests."""

    @endpoint
    async def broadcast_random(
        self, seed: int, numel: int, dtype: str, use_torch: bool = False, timeout_s: float = 30.0
    ) -> str:
        """Rank 0 broadcasts seeded random data; every rank returns the digest of what it holds."""
        dtype_ = getattr(torch, dtype)
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (numel * dtype_.itemsize,), dtype=torch.uint8, generator=g).view(dtype_)
        t = (data if self.sync_group.rank == 0 else torch.zeros_like(data)).cuda()

        def run() -> None:
            if use_torch:
                self._torch_group()
                torch.distributed.broadcast(t, src=0)
                torch.cuda.synchronize()
            else:
                self.sync_comm.broadcast(t, 0, timeout_s=timeout_s).wait(timeout_s)

        await asyncio.to_thread(run)
        return digest({"t": t})

    @endpoint
    async def cuda_still_works(self) -> float:
        return float(torch.ones(4, device="cuda").sum().item())

    def _torch_group(self) -> None:
        if not torch.distributed.is_initialized():
            store = torch.distributed.PrefixStore("torch-dist/", self.sync_group.store)
            torch.distributed.init_process_group(
                "nccl",
                store=store,
                rank=self.sync_group.rank,
                world_size=self.sync_group.world_size,
                device_id=torch.device("cuda", 0),
            )


async def staged_rounds(sender, receivers, versions: int = 6) -> None:
    """A delta sender and staging receivers already in one group: the first sync taken in the
    receivers' calls, then each later one completes with no call to them (`wait_for`), their
    weights unchanged until `apply` and bit-exactly the sender's after it."""
    await asyncio.gather(sender.setup(delta=True), *(r.setup(notices=True) for r in receivers))
    sent, *got = await asyncio.gather(sender.step_and_send(0), *(r.receive(0) for r in receivers))
    assert got == [sent] * len(receivers)
    await asyncio.gather(*(r.stage() for r in receivers))
    for version in range(1, versions):
        previous, sent = sent, await asyncio.wait_for(sender.step_and_send(version, version % 2 == 1), 30)
        for receiver in receivers:
            assert await receiver.apply(version) == (previous, sent), version
    deltas = [await m.deltas() for m in [sender, *receivers]]
    assert deltas == [versions - 2] * (1 + len(receivers)), deltas  # v0 and v1 full: the copy had no base yet


def mapped_allocations(member: SyncMember) -> int:
    """Allocations a CUDA IPC communicator has mapped (-1 for another backend)."""
    return getattr(member.sync_comm, "mapped", -1)
