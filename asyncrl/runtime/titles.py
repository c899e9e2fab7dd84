"""What ``ps``, ``top``, ``htop`` and ``nvidia-smi`` show of a process asyncrl started: its title,
and the environment it was given.

Every process of a run is ``python`` to the kernel, and an actor forked from the zygote even shows
the zygote's command line and environment. So each process titles itself by its role and the run
it belongs to, as vLLM (``VLLM::EngineCore``) and Ray (``ray::Class.method``) title theirs:
``asyncrl: trainer [grpo-20261207-101500]``, ``asyncrl: sampler1 [...]``, ``asyncrl: zygote
[...]``, ``asyncrl: launch grpo_countdown.py [...]``, ``asyncrl: node1 agent``. The run's name is
`ENV_RUN` in the environment: a GRPO run sets it (rl/launch.py) before its supervisor starts, so
the zygote and every local actor inherit it, and the supervisor hands it to actors on other nodes
in their environment (`run_env`).

The title is written with ``setproctitle`` over the process's command line only (``SPT_NOENV``):
by default it would also take the memory the kernel shows as ``/proc/PID/environ``, which ``ps e``
and scripts read. So a title has the room of the command line asyncrl started the process with
(a worker's ``python -c "from asyncrl.runtime.worker import main; main()"``), and a longer one is
cut at its end, where the run's name is.

An actor forked from the zygote has the environment it asked for in ``os.environ`` and in the C
library's ``environ`` (what it and its children read: zygotes/serve.py sets it), but the kernel
shows the block the zygote was started with. `show_environ` writes the actor's own into that
block, which the zygote keeps free of references (`own_environ`) and starts with `ROOM_BYTES`
to spare (`ENV_ROOM`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import setproctitle

ENV_RUN = "ASYNCRL_RUN_NAME"
"""The run a process belongs to, shown in its title (``[RUN]``); unset: no run in the title."""
ENV_ROOM = "ASYNCRL_ZYGOTE_ENV_ROOM"
"""Padding in a zygote's environment block: where a forked actor's own environment goes
(`show_environ`), which is larger than the zygote's by the actor's own variables."""
ROOM_BYTES = 4096
PREFIX = "asyncrl: "

_role = ""


def title(role: str, run: str = "") -> str:
    """``asyncrl: ROLE [RUN]`` (without `` [RUN]`` when ``run`` is empty)."""
    return f"{PREFIX}{role} [{run}]" if run else f"{PREFIX}{role}"


def set_title(role: str) -> None:
    """Title this process by ``role`` and the run in its environment (`ENV_RUN`)."""
    global _role
    _role = role
    added = "SPT_NOENV" not in os.environ
    if added:  # read once, at the first title: the environment's memory stays the environment's
        os.environ["SPT_NOENV"] = "1"
    try:
        setproctitle.setproctitle(title(role, os.environ.get(ENV_RUN, "")))
    finally:
        if added:  # not for the processes this one starts
            del os.environ["SPT_NOENV"]


def name_run(run: str) -> None:
    """This process, and those it starts from now on, belong to ``run``: in the environment
    (`ENV_RUN`), and in this process's title if it has one."""
    os.environ[ENV_RUN] = run
    if _role:
        set_title(_role)


def run_env() -> dict[str, str]:
    """`ENV_RUN` as this process has it, for an actor's environment wherever it runs ({} unset)."""
    run = os.environ.get(ENV_RUN)
    return {ENV_RUN: run} if run is not None else {}


def own_environ() -> None:
    """Copy every variable of the C library's ``environ`` out of the block the kernel shows, so no
    pointer a module takes from ``getenv`` from now on points into it (the zygote, before it
    preloads: `show_environ` overwrites that block in its children)."""
    for key, value in os.environ.items():
        os.putenv(key, value)  # setenv: a copy of its own, in place of the pointer into the block


def _environ_block() -> tuple[int, int]:
    """Where the kernel's ``/proc/self/environ`` reads from: ``env_start`` and ``env_end`` (the
    50th and 51st fields of ``/proc/self/stat``, after the parenthesised name)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[47]), int(fields[48])


def show_environ(env: Mapping[str, str]) -> bool:
    """Write ``env`` over this process's exec-time environment block, the rest of it zeroed, so
    that ``/proc/PID/environ`` shows ``env``. Only for a forked child of `own_environ`'s process
    whose ``environ`` was set from ``env`` (nothing points into the block any more). Where not all
    of it fits, asyncrl's own variables go first and a variable that does not fit is left out
    whole; returns whether all fitted."""
    start, end = _environ_block()
    entries = [f"{key}={value}".encode() + b"\0" for key, value in env.items()]
    fits = sum(map(len, entries)) <= end - start
    if not fits:  # what tells one actor from another first
        entries.sort(key=lambda entry: not entry.startswith(b"ASYNCRL_"))
    block = bytearray(end - start)
    used = 0
    for entry in entries:
        if used + len(entry) > len(block):
            continue
        block[used : used + len(entry)] = entry
        used += len(entry)
    ctypes.memmove(start, bytes(block), len(block))
    return fits
