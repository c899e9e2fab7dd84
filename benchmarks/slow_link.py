"""Weight syncs over a rate-limited link, full against delta (``weight_sync.py --link 1gbit``).

The receiver runs in a network namespace of its own, joined to this one by a veth pair (as the
"hosts" of tests/test_multinode_netns.py are), and the sender's side of the pair is limited with
`tc`'s token bucket filter (``tbf rate RATE``), so every byte of the sync crosses a link of that
rate. Needs root, iproute2 and the kernel's tbf qdisc; netem (added delay) is not required and
not used. The sender is this process, the receiver a subprocess (``ip netns exec``); both hold the
``--shape`` state dict in bf16, and before each sync the sender changes ``--changed`` of every
tensor's elements. Each mode gets a group of its own; times are the sender's whole sync (first
vote to commit: the receiver has applied everything), medians over the syncs after the first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

from asyncrl.comm.gloo import GlooCommunicator
from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
from asyncrl.comm.weights import WeightReceiver, WeightSender

TIMEOUT_S = 600.0


def _run(*argv: str) -> None:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {out.stderr.strip()}")


def _rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"a link rate is a number and kbit, mbit or gbit (e.g. 1gbit), not {rate!r}")


@contextlib.contextmanager
def limited_link(rate: str):
    """A namespace behind a veth pair whose host side sends at ``rate``; yields (namespace,
    host-side address, namespace-side address) and removes it all after."""
    tag = os.getpid() % 10000
    ns, host_if, ns_if, subnet = f"asyncrl-link-{tag}", f"arl{tag}h", f"arl{tag}n", f"10.249.{tag % 200 + 20}"
    # the bucket holds a millisecond of the rate: no burst lets a small delta skip the limit
    burst = max(int(_rate_bytes(rate) / 1000), 16 << 10)
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", ns)
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", ns_if)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _run("tc", "qdisc", "add", "dev", host_if, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "400ms")
        # a TCPStore client looks up its peer's name; out here that lookup would wait 10 s
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/resolv.conf", "w") as f:
            f.write("nameserver 127.0.0.1\n")
        yield ns, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


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
    peer = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, __file__, host, str(port), *argv])
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
    with limited_link(args.link) as (ns, host, _):
        for delta in (False, True):
            start = time.perf_counter()
            stats = send(host, shapes, args.iters, args.bucket_mib << 20, args.changed, delta, ns, argv)
            rows.append((delta, stats, time.perf_counter() - start))
    print(
        f"\n{args.shape} state dict: {nbytes / (1 << 30):.2f} GiB bf16, buckets of {args.bucket_mib} MiB; one "
        f"receiver behind a {args.link} link (tc tbf on a veth pair); {args.changed:.2%} of values changed a sync; "
        f"{args.iters} syncs after the first"
    )
    print("| mode | bytes on the wire a sync | sync (median) | link rate used |")
    print("| --- | --- | --- | --- |")
    for delta, stats, _ in rows:
        later = stats[1:]
        sent = statistics.median(s.sent_bytes for s in later)
        seconds = statistics.median(s.seconds for s in later)
        used = sent / seconds / _rate_bytes(args.link)
        print(f"| {'delta' if delta else 'full'} | {sent:,.0f} | {seconds * 1e3:.0f} ms | {used:.0%} |")
    full, delta = (statistics.median(s.seconds for s in r[1][1:]) for r in rows)
    print(f"delta / full sync time: {delta / full:.3f} ({full / delta:.1f}x faster)")


if __name__ == "__main__":  # the receiver, in its namespace
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from weight_sync import SHAPES, qwen2_state_shapes

    host, port, shape, iters = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    receive(host, port, qwen2_state_shapes(*SHAPES[shape]), iters)
