"""Shared helpers: real processes, found and checked through /proc (no mocks)."""

from __future__ import annotations

import os
import signal
import time

import pytest


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    """Every living process below ``pid`` (children, grandchildren, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(entry)] = int(fields[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passes (tests only: observing other processes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_at_test_start: set[int] = set()


def new_descendants() -> set[int]:
    """The living processes below this one that the running test started (not, say, the
    multiprocessing resource tracker an in-process vLLM engine of an earlier module left running
    for the rest of the session, as it is meant to)."""
    return descendants(os.getpid()) - _at_test_start


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must leave no process of ours behind."""
    global _at_test_start
    before = _at_test_start = descendants(os.getpid())
    yield
    wait_until(lambda: not descendants(os.getpid()) - before, 5.0)
    left = descendants(os.getpid()) - before
    kill_all(left)
    assert not left, f"processes left behind: {sorted(left)}"


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> str:
    """A 64-wide one-layer Qwen2 warm-started for 400 steps (about 10 s, once per test session): it
    writes well-formed answers often enough that rewards differ within groups, so gradients and the
    optimiser state are not zero. For the GRPO runs of test_fault_tolerance and test_run_lifecycle."""
    import torch

    from asyncrl.rl.tasks.countdown import Countdown
    from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
    from asyncrl.rl.model.warm_start import default_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: see tests/test_sampler.py
    try:
        return default_model(
            ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128),
            WarmStartConfig(steps=400, batch_size=32, lr=3e-3, warmup_steps=10, n_examples=2000, eval_problems=0,
                            heldout_reserve=20),
            Countdown(), cache_dir=str(tmp_path_factory.mktemp("cache")), threads=1, log=lambda *a: None)
    finally:
        torch.set_num_threads(threads)
