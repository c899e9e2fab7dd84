"""Helpers for the multi-node tests: real node agents (``asyncrl launch --node-rank R``) as
subprocesses of the test, network namespaces joined by veth pairs (a node with an address of its
own, as a distinct host has), a free port, a secret file, and an actor that counts its calls."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from asyncrl import Actor, endpoint
from asyncrl.runtime.cluster import auth

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
DRIVER = os.path.join(SCRIPTS, "cluster_driver.py")
NODE_TIMEOUT_S = 3.0
"""Short enough to keep the tests quick, long enough for a loaded 2-core machine."""


class Counter(Actor):
    """Counts the calls it executed, so a test can prove that nothing else got through."""

    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    async def bump(self, by: int = 1) -> int:
        self.calls += by
        return self.calls

    @endpoint
    async def count(self) -> int:
        return self.calls


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)


NETNS_RUN = "/var/run/netns"
NETNS_EXEC = os.path.join(SCRIPTS, "netns_exec.py")


def netns_tool() -> str:
    """How namespaces are made here: "ip" (iproute2), else "pyroute2" where that library is
    installed (an image without iproute2, such as the GPU machines'), else "". The variable
    ``ASYNCRL_TEST_NETNS=pyroute2`` takes the second way where both are present."""
    if shutil.which("ip") is not None and os.environ.get("ASYNCRL_TEST_NETNS") != "pyroute2":
        return "ip"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return ""
    return "pyroute2"


def netns_argv(namespace: str, argv: list[str]) -> list[str]:
    """``argv`` run inside ``namespace``."""
    if netns_tool() == "ip":
        return ["ip", "netns", "exec", namespace, *argv]
    return [sys.executable, NETNS_EXEC, namespace, *argv]


def _veth_by_ip(ns: str, host_if: str, ns_if: str, subnet: str, links: list[str]) -> str:
    """One namespace joined to this one by a veth pair, with iproute2; "" or what failed."""
    out = ip("netns", "add", ns)
    if out.returncode != 0:
        return f"cannot create a network namespace here: {out.stderr.strip()}"
    steps = [
        ("link", "add", host_if, "type", "veth", "peer", "name", ns_if),
        ("link", "set", ns_if, "netns", ns),
        ("addr", "add", f"{subnet}.1/24", "dev", host_if),
        ("link", "set", host_if, "up"),
        ("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", ns_if),
        ("netns", "exec", ns, "ip", "link", "set", ns_if, "up"),
        ("netns", "exec", ns, "ip", "link", "set", "lo", "up"),
        ("netns", "exec", ns, "ip", "route", "add", "default", "via", f"{subnet}.1"),
    ]
    for step in steps:
        out = ip(*step)
        if out.returncode != 0:
            return f"cannot set up veth networking (`ip {' '.join(step)}`): {out.stderr.strip()}"
        if step[0] == "link" and step[1] == "add":
            links.append(host_if)
    return ""


def _veth_by_pyroute2(ns: str, host_if: str, ns_if: str, subnet: str, links: list[str]) -> str:
    """The same as `_veth_by_ip` through pyroute2's netlink calls."""
    from pyroute2 import IPRoute, NetNS, netns

    try:
        netns.create(ns)
    except OSError as exc:
        return f"cannot create a network namespace here: {exc}"
    try:
        with IPRoute() as host:
            host.link("add", ifname=host_if, kind="veth", peer={"ifname": ns_if, "net_ns_fd": ns})
            links.append(host_if)
            (index,) = host.link_lookup(ifname=host_if)
            host.addr("add", index=index, address=f"{subnet}.1", prefixlen=24)
            host.link("set", index=index, state="up")
        with NetNS(ns) as inside:
            (index,) = inside.link_lookup(ifname=ns_if)
            inside.addr("add", index=index, address=f"{subnet}.2", prefixlen=24)
            inside.link("set", index=index, state="up")
            (lo,) = inside.link_lookup(ifname="lo")
            inside.link("set", index=lo, state="up")
            inside.route("add", dst="0.0.0.0/0", gateway=f"{subnet}.1")
    except Exception as exc:  # netlink's errors: the test is skipped, saying which
        return f"cannot set up veth networking with pyroute2: {exc!r}"
    return ""


def rate_bytes(rate: str) -> float:
    """Bytes a second of a link rate written as tc writes it: a number and kbit, mbit or gbit."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * scale / 8
            except ValueError:
                break
    raise ValueError(f"a link rate is a number and kbit, mbit or gbit (e.g. 1gbit), not {rate!r}")


def _limit(tool: str, ns: str, host_if: str, ns_if: str, rate: str) -> str:
    """Each end of a veth pair sends at ``rate`` at most (tc's token bucket filter, both ways: the
    weights one way, the rollouts the other); "" or what failed. The bucket holds a millisecond of
    the rate, and never less than two of the 64 KiB packets the veth hands over whole (its
    segmentation offload), which a smaller bucket could never let through."""
    burst = max(int(rate_bytes(rate) / 1000), 128 << 10)
    if tool == "ip" and shutil.which("tc") is not None:
        for inside, dev in ((False, host_if), (True, ns_if)):
            argv = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst)]
            argv += ["latency", "400ms"]
            out = subprocess.run(
                ["ip", "netns", "exec", ns, *argv] if inside else argv, capture_output=True, text=True, timeout=15
            )
            if out.returncode != 0:
                return f"cannot limit the link to {rate} (`{' '.join(argv)}`): {out.stderr.strip()}"
        return ""
    try:
        from pyroute2 import IPRoute, NetNS

        for side, dev in ((IPRoute, host_if), (lambda: NetNS(ns), ns_if)):
            with side() as link:
                (index,) = link.link_lookup(ifname=dev)
                link.tc("add", "tbf", index, 0x10000, rate=rate, burst=burst, latency="400ms")
    except Exception as exc:  # no tc, no pyroute2, no tbf in this kernel: the caller says so
        return f"cannot limit the link to {rate} with pyroute2: {exc!r}"
    return ""


def _remove(tool: str, namespaces: list[str], links: list[str]) -> None:
    if tool == "ip":
        for ns in namespaces:
            ip("netns", "del", ns)  # takes its end of the veth pair, and so the pair, with it
        for link in links:
            ip("link", "del", link)
        return
    from pyroute2 import IPRoute, netns

    for ns in namespaces:
        with contextlib.suppress(OSError):
            netns.remove(ns)
    with IPRoute() as host:
        for link in links:
            for index in host.link_lookup(ifname=link):
                with contextlib.suppress(Exception):
                    host.link("del", index=index)


@contextlib.contextmanager
def veth_namespaces(count: int = 2, rate: str = "") -> Iterator[list[tuple[str, str, str]]]:
    """``count`` network namespaces, each linked to this one by a veth pair on its own /24; yields
    ``[(namespace, host-side address, namespace-side address), ...]`` and removes them all after.
    ``rate`` (tc's notation, e.g. "1gbit"): each pair's two ends send at that rate at most.
    Skips the test (saying why) where that is not permitted: not root, neither `ip` nor pyroute2,
    no CAP_NET_ADMIN."""
    tool = netns_tool()
    if not tool:
        pytest.skip("neither the `ip` tool (iproute2) nor pyroute2 is installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    make = _veth_by_ip if tool == "ip" else _veth_by_pyroute2
    tag = str(os.getpid() % 100000)
    octet = os.getpid() % 200 + 20
    made: list[str] = []
    links: list[str] = []
    try:
        for i in range(1, count + 1):
            ns = f"asyncrl-{tag}-{i}"
            host_if, ns_if = f"ar{tag}h{i}", f"ar{tag}n{i}"
            error = make(ns, host_if, ns_if, f"10.{230 + i}.{octet}", links)
            if os.path.exists(os.path.join(NETNS_RUN, ns)):
                made.append(ns)
            if rate and not error:
                error = _limit(tool, ns, host_if, ns_if, rate)
            if error:
                pytest.skip(error)
            _fail_fast_dns(ns)
        yield [(ns, f"10.{230 + i}.{octet}.1", f"10.{230 + i}.{octet}.2") for i, ns in enumerate(made, 1)]
    finally:
        _remove(tool, made, links)
        for ns in made:
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(NETNS_ETC)  # if empty: it may be ours


NETNS_ETC = "/etc/netns"
"""`ip netns exec NS` bind-mounts the files of /etc/netns/NS over /etc's."""


def _fail_fast_dns(namespace: str) -> None:
    """Give ``namespace`` a resolver that fails at once: this host's name server is out of its
    reach, and a TCPStore client looks up its peer's name (the reverse of an address) when it
    connects, which would wait 10 s for it (c10d's "hostname of the client socket cannot be
    retrieved"). Nothing listens on port 53 of its loopback, so a lookup is refused at once."""
    try:
        os.makedirs(os.path.join(NETNS_ETC, namespace), exist_ok=True)
        with open(os.path.join(NETNS_ETC, namespace, "resolv.conf"), "w") as f:
            f.write("nameserver 127.0.0.1\n")
    except OSError:
        pass  # a slower first connection, no more


def netns_pids(namespace: str) -> list[int]:
    """The processes still running in ``namespace``: those whose network namespace is its file's."""
    try:
        wanted = os.stat(os.path.join(NETNS_RUN, namespace)).st_ino
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == wanted:
                    found.append(int(entry))
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_secret_file(directory: str) -> str:
    path = os.path.join(directory, "cluster.secret")
    auth.write_secret(path)
    return path


def env(**extra: str) -> dict[str, str]:
    """This process's environment without any node or cluster setting (each launch sets its own)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCRL_", "PET_", "SLURM_"))}
    pythonpath = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    return {**base, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **extra}


def launch_argv(
    rank: int,
    nnodes: int,
    port: int,
    secret_file: str,
    master: str = "127.0.0.1",
    script: str = DRIVER,
    *script_args: str,
    join_timeout_s: float = 60.0,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "launch",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(rank),
        "--master-addr",
        master,
        "--master-port",
        str(port),
        "--secret-file",
        secret_file,
        "--node-timeout-s",
        str(NODE_TIMEOUT_S),
        "--join-timeout-s",
        str(join_timeout_s),
        script,
        *script_args,
    ]


def start_agent(
    rank: int,
    nnodes: int,
    port: int,
    secret_file: str,
    log_dir: str,
    master: str = "127.0.0.1",
    netns: str | None = None,
    join_timeout_s: float = 60.0,
    **extra_env: str,
) -> subprocess.Popen:
    argv = launch_argv(rank, nnodes, port, secret_file, master, join_timeout_s=join_timeout_s)
    if netns is not None:
        argv = netns_argv(netns, argv)
    with open(os.path.join(log_dir, f"agent-{rank}.log"), "ab") as log:
        return subprocess.Popen(
            argv, env=env(**extra_env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )


def agent_log(log_dir: str, rank: int) -> str:
    with open(os.path.join(log_dir, f"agent-{rank}.log"), encoding="utf-8", errors="replace") as f:
        return f.read()


def intruder(ctx, endpoint: str, how: str, public_key: bytes):
    """A DEALER that tries to get in without the cluster secret. ``how``: 'none' (no security at
    all), 'wrong-secret' (keys derived from another secret), 'foreign-key' (the server's real public
    key, but a client key pair of its own: passes CURVE, must fail the allow-list)."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if how == "wrong-secret":
        auth.ClusterKeys.from_secret(auth.new_secret()).secure_client(sock)
    elif how == "foreign-key":
        pub, sec = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public_key, pub, sec
    elif how != "none":
        raise ValueError(how)
    sock.connect(endpoint)
    return sock
