"""Helpers for the multi-node tests: real node agents (``asyncrl launch --node-rank R``) as
subprocesses of the test, a free port, a secret file, and an actor that counts its calls."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_secret_file(directory: str) -> str:
    path = os.path.join(directory, "cluster.secret")
    auth.write_secret(path)
    return path


def env(**extra: str) -> dict[str, str]:
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
