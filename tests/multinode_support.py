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
from typing import Iterator

import pytest

from asyncrl import Actor, endpoint
from asyncrl.runtime import auth

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


@contextlib.contextmanager
def veth_namespaces(count: int = 2) -> Iterator[list[tuple[str, str, str]]]:
    """``count`` network namespaces, each linked to this one by a veth pair on its own /24; yields
    ``[(namespace, host-side address, namespace-side address), ...]`` and removes them all after.
    Skips the test (saying why) where that is not permitted: not root, no `ip`, no CAP_NET_ADMIN."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    tag = str(os.getpid() % 100000)
    octet = os.getpid() % 200 + 20
    made, links = [], []
    try:
        for i in range(1, count + 1):
            subnet = f"10.{230 + i}.{octet}"
            ns, host_if, ns_if = f"asyncrl-{tag}-{i}", f"ar{tag}h{i}", f"ar{tag}n{i}"
            out = ip("netns", "add", ns)
            if out.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {out.stderr.strip()}")
            made.append(ns)
            _fail_fast_dns(ns)
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
                    pytest.skip(f"cannot set up veth networking (`ip {' '.join(step)}`): {out.stderr.strip()}")
                if step[0] == "link" and step[1] == "add":
                    links.append(host_if)
        yield [(ns, f"10.{230 + i}.{octet}.1", f"10.{230 + i}.{octet}.2") for i, ns in enumerate(made, 1)]
    finally:
        for ns in made:
            ip("netns", "del", ns)  # takes its end of the veth pair, and so the pair, with it
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(NETNS_ETC)  # if empty: it may be ours
        for link in links:
            ip("link", "del", link)


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
    """The processes still running in ``namespace``."""
    return [int(p) for p in ip("netns", "pids", namespace).stdout.split()]


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


def launch_argv(rank: int, nnodes: int, port: int, secret_file: str, master: str = "127.0.0.1", script: str = DRIVER,
                *script_args: str, join_timeout_s: float = 60.0) -> list[str]:
    return [
        sys.executable, "-m", "asyncrl.cli", "launch", "--nnodes", str(nnodes), "--node-rank", str(rank),
        "--master-addr", master, "--master-port", str(port), "--secret-file", secret_file,
        "--node-timeout-s", str(NODE_TIMEOUT_S), "--join-timeout-s", str(join_timeout_s), script, *script_args,
    ]


def start_agent(rank: int, nnodes: int, port: int, secret_file: str, log_dir: str, master: str = "127.0.0.1",
                netns: str | None = None, join_timeout_s: float = 60.0, **extra_env: str) -> subprocess.Popen:
    argv = launch_argv(rank, nnodes, port, secret_file, master, join_timeout_s=join_timeout_s)
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    with open(os.path.join(log_dir, f"agent-{rank}.log"), "ab") as log:
        return subprocess.Popen(argv, env=env(**extra_env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


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
