"""Weight-sync throughput: our bucketed sync next to a raw torch.distributed broadcast of the same bytes.

    python benchmarks/weight_sync.py --shape 0.5b --receivers 1            # GPUs: one sender, one receiver
    python benchmarks/weight_sync.py --shape tiny --backend gloo --receivers 3   # CPU
    python benchmarks/weight_sync.py --shape 0.5b --backend ipc                  # one GPU, colocated
    python benchmarks/weight_sync.py --shape tiny --backend gloo --delta --changed 0.003   # delta syncs
    python benchmarks/weight_sync.py --shape 0.5b --link 1gbit --changed 0.003 --iters 3  # root: full vs delta
    python benchmarks/weight_sync.py --shape 0.5b --profile out/ws-trace        # and a trace of 3 more syncs

Each member is an actor on its own GPU (or CPU process). A "sync" is the whole of
`WeightSender.send` / `WeightReceiver.receive`: vote, pack into buckets, broadcast, unpack into the
receiver's parameters, commit. "raw" is `torch.distributed.broadcast` of one flat buffer holding
the same bytes, in the same processes, followed by a device synchronize (with ``--backend ipc``,
where every member shares one GPU and NCCL cannot run, "raw" is one device-to-device copy of those
bytes inside the sender: the floor of any transfer on that GPU). Times per iteration are
the slowest member's; the table shows medians. The first sync is reported apart, together with the
time to form the group (rendezvous and communicator creation).

``--changed F``: before each sync (outside its time) the sender changes a fraction F of the
elements of every tensor, at random places (as a train step changes some of a bf16 copy);
``--delta``: the sender keeps its base and sends only the changes (``--run.sync_delta on``).
The table then also gives the bytes each sync put on the wire. ``--link RATE`` (root, iproute2,
tc's tbf): the receiver behind a veth link limited to RATE, full against delta (``slow_link.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch
import torch.distributed as dist

from asyncrl import Supervisor, endpoint
from asyncrl.comm.member import SyncMember, form_group
from asyncrl.comm.weights import WeightReceiver, WeightSender
from state_shapes import SHAPES, qwen2_state_shapes


class Member(SyncMember):
    def __init__(self, shape: str, device: str, sender: bool):
        self.device = torch.device(device)
        if self.device.type == "cuda":  # each member sees only its own GPU
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        self.state = {
            name: torch.empty(s, dtype=torch.bfloat16, device=self.device)
            for name, s in qwen2_state_shapes(*SHAPES[shape]).items()
        }
        for t in self.state.values():
            t.normal_() if sender else t.zero_()
        self.is_sender = sender
        self.sync: WeightSender | WeightReceiver | None = None
        self.version = -1
        self.stats: list = []  # SyncStats of every sync
        self.rng = torch.Generator(device=self.device).manual_seed(0)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @endpoint
    async def setup(self, bucket_bytes: int, delta: bool = False) -> tuple[int, int]:
        def build():
            if self.is_sender:
                return WeightSender.create(
                    self.sync_comm, self.sync_group, self.state, bucket_bytes=bucket_bytes, delta=delta
                )
            return WeightReceiver.create(self.sync_comm, self.sync_group, expect=self.state)

        self.sync = await asyncio.to_thread(build)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        return len(self.sync.layout.buckets), self.sync.layout.bucket_bytes

    @endpoint
    async def syncs(self, iters: int, changed: float = 0.0) -> list[float]:
        return await asyncio.to_thread(self._syncs, iters, changed)

    def _syncs(self, iters: int, changed: float) -> list[float]:
        times = []
        for _ in range(iters):
            self.version += 1
            if self.is_sender and changed:
                self._change(changed)
            self._synchronize()
            start = time.perf_counter()
            if self.is_sender:
                stats = self.sync.send(self.version)
            else:
                stats = self.sync.receive(self.version, self.state)
            self.stats.append(stats)
            self._synchronize()
            times.append(time.perf_counter() - start)
        return times

    @endpoint
    async def profiled_syncs(self, iters: int, changed: float, path: str) -> None:
        """``iters`` more syncs under torch's profiler (host and, on CUDA, device activity); its
        trace, for chrome://tracing or Perfetto, written to ``path``."""

        def run():
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            with profile(activities=activities) as prof:
                self._syncs(iters, changed)
            prof.export_chrome_trace(path)

        await asyncio.to_thread(run)

    def _change(self, fraction: float) -> None:
        """A fraction of every tensor's elements, at random places, moved by one."""
        for t in self.state.values():
            flat = t.view(-1)
            count = max(1, round(flat.numel() * fraction))
            where = torch.randint(0, flat.numel(), (count,), generator=self.rng, device=self.device)
            flat[where] += 1

    @endpoint
    async def phases(self, last: int) -> dict[str, float]:
        """Medians over the last ``last`` syncs of this member's phases (`SyncStats`), in ms, and
        of the bytes each put on the wire."""
        keys = ("vote_s", "move_s", "commit_s", "copy_s", "transfer_s")
        medians = {k[:-2]: statistics.median(getattr(s, k) for s in self.stats[-last:]) * 1e3 for k in keys}
        return {**medians, "sent_bytes": statistics.median(s.sent_bytes for s in self.stats[-last:])}

    @endpoint
    async def raw_broadcasts(self, iters: int) -> list[float]:
        def run():
            if not dist.is_initialized():
                store = dist.PrefixStore("raw/", self.sync_group.store)
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                kwargs = {"device_id": self.device} if backend == "nccl" else {}
                dist.init_process_group(
                    backend, store=store, rank=self.sync_group.rank, world_size=self.sync_group.world_size, **kwargs
                )
            total = sum(t.numel() for t in self.state.values())
            flat = torch.empty(total, dtype=torch.bfloat16, device=self.device)
            dist.broadcast(flat, src=0)  # warm-up: connects NCCL's channels for this size
            times = []
            for _ in range(iters):
                self._synchronize()
                start = time.perf_counter()
                dist.broadcast(flat, src=0)
                self._synchronize()
                times.append(time.perf_counter() - start)
            del flat
            return times

        return await asyncio.to_thread(run)

    @endpoint
    async def raw_copies(self, iters: int) -> list[float]:
        """One device-to-device copy of the state's bytes per iteration (the colocated floor)."""

        def run():
            total = sum(t.numel() for t in self.state.values())
            src, dst = (torch.empty(total, dtype=torch.bfloat16, device=self.device) for _ in range(2))
            times = []
            for _ in range(iters):
                self._synchronize()
                start = time.perf_counter()
                dst.copy_(src)
                self._synchronize()
                times.append(time.perf_counter() - start)
            del src, dst
            return times

        return await asyncio.to_thread(run)

    @endpoint
    async def extra_peak_bytes(self) -> int:
        """Peak device memory beyond the parameters since set-up (the staging buffers)."""
        if self.device.type != "cuda":
            return -1
        return torch.cuda.max_memory_allocated() - sum(t.nbytes for t in self.state.values())


def slowest(per_member: list[list[float]]) -> list[float]:
    return [max(times) for times in zip(*per_member)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--bucket-mib", type=int, default=0, help="0: the library's default for the weights' size")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo", "ipc"], default="auto")
    parser.add_argument("--delta", action="store_true", help="send only what changed (--run.sync_delta on)")
    parser.add_argument("--changed", type=float, default=0.0, help="fraction of elements changed before each sync")
    parser.add_argument("--link", default="", help="e.g. 1gbit: over a rate-limited veth link, full and delta")
    parser.add_argument("--profile", default="", help="a folder: 3 more syncs profiled, a trace per member there")
    args = parser.parse_args()
    if args.link:
        import slow_link

        # on a thread: pyroute2's netlink calls (where iproute2 is missing) run an event loop of their own
        await asyncio.to_thread(slow_link.main, args, qwen2_state_shapes(*SHAPES[args.shape]))
        return
    cuda = args.backend != "gloo" and torch.cuda.is_available()
    device, gpus = ("cuda", 1) if cuda else ("cpu", 0)
    nbytes = sum(torch.Size(s).numel() * 2 for s in qwen2_state_shapes(*SHAPES[args.shape]).values())

    async with Supervisor(device_kind="cuda" if cuda else "auto") as sup:
        members = [await sup.spawn(Member, args.shape, device, True, name="sender", gpus=gpus)]
        colocated = args.backend == "ipc"
        for i in range(args.receivers):
            members.append(
                await sup.spawn(
                    Member,
                    args.shape,
                    device,
                    False,
                    name=f"receiver{i}",
                    gpus=0 if colocated else gpus,
                    share_devices_with="sender" if colocated else None,
                )
            )
        start = time.perf_counter()
        await form_group(
            members,
            "127.0.0.1",
            backend=args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo"),
            timeout_s=120,
        )
        buckets = await asyncio.gather(*(m.setup(args.bucket_mib << 20, args.delta) for m in members))
        first = slowest(await asyncio.gather(*(m.syncs(1) for m in members)))[0]
        first_total = time.perf_counter() - start
        ours = slowest(await asyncio.gather(*(m.syncs(args.iters, args.changed) for m in members)))
        phases = await asyncio.gather(*(m.phases(args.iters) for m in members))
        extra = await asyncio.gather(*(m.extra_peak_bytes() for m in members))  # before raw's flat buffer
        raw = (
            await members[0].raw_copies(args.iters)
            if colocated
            else slowest(await asyncio.gather(*(m.raw_broadcasts(args.iters) for m in members)))
        )
        created = await asyncio.gather(*(m.sync_created() for m in members))
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            names = ["sender"] + [f"receiver{i}" for i in range(args.receivers)]
            traces = [os.path.abspath(os.path.join(args.profile, f"{name}.json")) for name in names]
            await asyncio.gather(*(m.profiled_syncs(3, args.changed, t) for m, t in zip(members, traces)))
            print(f"traces of 3 syncs: {', '.join(traces)}")

    report(args, device, colocated, nbytes, buckets[0], (first, first_total), ours, raw, phases, extra, created)


def report(args, device, colocated, nbytes, buckets, first, ours, raw, phases, extra, created) -> None:
    """The table and the per-member lines (``first``: the first sync alone, and with set-up)."""
    first, first_total = first
    cuda = device == "cuda"
    gib = nbytes / (1 << 30)
    ours_s, raw_s = statistics.median(ours), statistics.median(raw)
    print(
        f"\n{args.shape} state dict: {gib:.2f} GiB bf16 in {buckets[0]} buckets of {buckets[1] >> 20} MiB; "
        f"1 sender + {args.receivers} receiver(s) on {device}; {args.iters} syncs"
    )
    print("| what | median | effective GiB/s |")
    print("| --- | --- | --- |")
    print(
        f"| form group + set-up + first sync | {first_total * 1e3:.1f} ms (first sync alone {first * 1e3:.1f} ms) | |"
    )
    print(f"| sync (pack, broadcast, unpack, commit) | {ours_s * 1e3:.2f} ms | {gib / ours_s:.1f} |")
    raw_what = "one device-to-device copy (floor)" if colocated else "raw torch.distributed.broadcast"
    print(f"| {raw_what} | {raw_s * 1e3:.2f} ms | {gib / raw_s:.1f} |")
    print(f"| ours / raw | {raw_s / ours_s * 100:.0f}% | |")
    sent = phases[0].pop("sent_bytes")
    print(
        f"| bytes on the wire a sync ({'delta' if args.delta else 'full'}, {args.changed:.2%} changed) "
        f"| {sent:,.0f} ({sent / nbytes:.2%} of the state) | |"
    )
    for name, ph in zip(["sender"] + [f"receiver{i}" for i in range(args.receivers)], phases):
        ph.pop("sent_bytes", None)
        print(f"{name} phases, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    print(f"communicators created per member over {args.iters + 1} syncs: {[c for c in created]}")
    if cuda:
        print(f"peak device memory beyond the parameters (MiB): {[round(e / (1 << 20)) for e in extra]}")


if __name__ == "__main__":
    asyncio.run(main())
