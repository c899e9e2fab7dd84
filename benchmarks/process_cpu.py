"""The CPU each process of a run uses, by its role: what bounds a sampler whose GPU is idle.

A run's processes title themselves (``asyncrl/runtime/titles.py``: ``asyncrl: sampler0 [RUN]``), and
vLLM titles its engine core ``VLLM::EngineCore``; an engine core is named after the process that
started it (``sampler0 engine``). `ProcessCpu` reads ``/proc`` twice a second in a thread: each
titled process's user + system CPU time (all its threads, not its children's). `ProcessCpu.cores`
is the CPU each role used over a window, in cores (1.0: one core busy all the time); a process the
window saw only once counts nothing.

Linux only (``/proc``); elsewhere it records nothing.
"""

from __future__ import annotations

import os
import threading
import time

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
TITLED = ("asyncrl: ", "VLLM::")


def _title(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


def _stat(pid: str) -> tuple[int, int]:
    """(parent pid, user + system ticks) of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
    return int(fields[1]), int(fields[11]) + int(fields[12])


def role(title: str, parent_title: str = "") -> str:
    """``sampler0`` for ``asyncrl: sampler0 [RUN]``; an engine core (``VLLM::EngineCore``) under
    ``asyncrl: sampler0 [RUN]`` is ``sampler0 engine``; "" for a process of neither kind."""
    if title.startswith("asyncrl: "):
        return title[len("asyncrl: ") :].split(" [", 1)[0]
    if title.startswith("VLLM::"):
        owner = role(parent_title)
        return f"{owner} engine" if owner else title.split()[0]
    return ""


class ProcessCpu:
    """Samples the titled processes' CPU time every ``interval_s`` until `close`."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.samples: dict[int, list[tuple[float, int]]] = {}  # pid: (time.time(), ticks)
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)

    def sample(self) -> None:
        """One reading of every titled process (a process that ends meanwhile is skipped)."""
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return
        titles: dict[str, str] = {}
        for pid in pids:
            try:
                titles[pid] = _title(pid)
            except OSError:
                continue
        now = time.time()
        for pid, title in titles.items():
            if not title.startswith(TITLED):
                continue
            try:
                parent, ticks = _stat(pid)
            except (OSError, IndexError, ValueError):
                continue
            name = role(title, titles.get(str(parent), ""))
            if name:
                self.roles[int(pid)] = name
                self.samples.setdefault(int(pid), []).append((now, ticks))

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Each role's CPU between two wall-clock times, in cores, highest first."""
        used: dict[str, float] = {}
        for pid, samples in self.samples.items():
            seen = [s for s in samples if start <= s[0] <= end]
            if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
                continue
            share = (seen[-1][1] - seen[0][1]) / TICKS_PER_S / (seen[-1][0] - seen[0][0])
            used[self.roles[pid]] = used.get(self.roles[pid], 0.0) + share
        return {k: round(v, 2) for k, v in sorted(used.items(), key=lambda kv: -kv[1])}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
