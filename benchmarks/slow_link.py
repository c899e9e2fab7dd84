"""Weight syncs over a rate-limited link, full against delta (``weight_sync.py --link 1gbit``).

The receiver runs in a network namespace of its own, joined to this one by a veth pair whose two
ends are limited with tc's token bucket filter (``tbf rate RATE``; the "hosts" of the multi-node
tests, `tests/multinode_support.veth_namespaces`), so every byte of the sync crosses a link of
that rate. Needs root, the kernel's tbf qdisc, and iproute2 or pyroute2 (the GPU machines' image
has no iproute2); netem (added delay) is not used. The sender is this process, the receiver a
subprocess in the namespace; both hold the ``--shape`` state dict in bf16, and before each sync
the sender changes ``--changed`` of every tensor's elements. Each mode gets a group of its own;
times are the sender's whole sync (first vote to commit: the receiver has applied everything),
medians over the syncs after the first.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

from asyncrl.comm.gloo import GlooCommunicator
from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
from asyncrl.comm.weights import WeightReceiver, WeightSender

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import pytest  # noqa: E402  (veth_namespaces says why it cannot make a namespace by pytest's skip)

from multinode_support import netns_argv, rate_bytes, veth_namespaces  # noqa: E402

TIMEOUT_S = 600.0


def make_state(shapes: dict[str, tuple[int, ...]], sender: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=g) if sender else torch.zeros(s)).bfloat16() for n, s in shapes.items()}


def change(state: dict[str, torch.Tensor], fraction: float, g: torch.Generator) -> None:
    for t in state.values():
        flat = t.view(-1)
        where = torch.randint(0, flat.numel(), (max(1, round(flat.numel() * fraction)),), generator=g)
        flat[where] += 1


def receive(host: str, port: int, shapes: dict[str, tuple[int, ...]], iters: int) -> None:
    """The receiver's side (in the namespace): ``iters + 1`` syncs into a bf16 state dict."""
    group = StoreGroup.create(host, port, 1, 2, 120)
    comm = GlooCommunicator.create(group, TIMEOUT_S)
    try:
        state = make_state(shapes, sender=False)
        receiver = WeightReceiver.create(comm, group, expect=state, timeout_s=TIMEOUT_S)
        for version in range(iters + 1):
            receiver.receive(version, state)
    finally:
        comm.close()
        group.close()


def send(host: str, shapes, iters: int, bucket_bytes: int, changed: float, delta: bool, ns: str, argv) -> list:
    listener = reserve_listener(host)
    port = listener.getsockname()[1]
    peer = subprocess.Popen(netns_argv(ns, [sys.executable, __file__, host, str(port), *argv]))
    try:
        group = StoreGroup.create(host, port, 0, 2, 120, listener=listener)
        comm = GlooCommunicator.create(group, TIMEOUT_S)
        state, g, stats = make_state(shapes, sender=True), torch.Generator().manual_seed(1), []
        try:
            sender = WeightSender.create(
                comm, group, state, bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S, delta=delta
            )
            for version in range(iters + 1):
                if version:
                    change(state, changed, g)
                stats.append(sender.send(version))
        finally:
            comm.close()
        peer.wait(60)
        group.close()
        return stats
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)


def main(args, shapes: dict[str, tuple[int, ...]]) -> None:
    """``weight_sync.py --link RATE``: full, then delta, over one rate-limited link."""
    nbytes = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    argv = [args.shape, str(args.iters)]
    rows = []
    try:
        with veth_namespaces(1, rate=args.link) as ((ns, host, _),):
            for delta in (False, True):
                start = time.perf_counter()
                stats = send(host, shapes, args.iters, args.bucket_mib << 20, args.changed, delta, ns, argv)
                rows.append((delta, stats, time.perf_counter() - start))
    except pytest.skip.Exception as exc:
        raise SystemExit(f"weight_sync.py --link: {exc}") from None
    size = f"{args.bucket_mib} MiB" if args.bucket_mib else "the default size"
    print(
        f"\n{args.shape} state dict: {nbytes / (1 << 30):.2f} GiB bf16, buckets of {size}; one "
        f"receiver behind a {args.link} link each way (tc tbf on a veth pair); {args.changed:.2%} of values "
        f"changed a sync; {args.iters} syncs after the first"
    )
    print("| mode | bytes on the wire a sync | sync (median) | link rate used |")
    print("| --- | --- | --- | --- |")
    for delta, stats, _ in rows:
        later = stats[1:]
        sent = statistics.median(s.sent_bytes for s in later)
        seconds = statistics.median(s.seconds for s in later)
        used = sent / seconds / rate_bytes(args.link)
        print(f"| {'delta' if delta else 'full'} | {sent:,.0f} | {seconds * 1e3:.0f} ms | {used:.0%} |")
    full, delta = (statistics.median(s.seconds for s in r[1][1:]) for r in rows)
    print(f"delta / full sync time: {delta / full:.3f} ({full / delta:.1f}x faster)")


if __name__ == "__main__":  # the receiver, in its namespace
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from state_shapes import SHAPES, qwen2_state_shapes

    host, port, shape, iters = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    receive(host, port, qwen2_state_shapes(*SHAPES[shape]), iters)
