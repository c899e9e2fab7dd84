"""``benchmarks/process_cpu.py``, what `grpo_gpu.py` reports of each process's CPU: read from /proc
for real processes titled as asyncrl's and vLLM's are, a busy one against a sleeping one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from process_cpu import ProcessCpu, role  # noqa: E402


def waiter(title: str) -> str:
    """A process titled ``title`` that says it is up, then waits for its stdin to close."""
    return f"import sys, setproctitle; setproctitle.setproctitle({title!r}); print('up', flush=True); sys.stdin.read()"


# A process titled "asyncrl: spinner [test]" that busy-loops, with a waiting child titled as vLLM's
# engine core is; both end when their stdin closes.
SPINNER = f"""
import subprocess, sys, threading, setproctitle
setproctitle.setproctitle("asyncrl: spinner [test]")
pipe = subprocess.PIPE
engine = subprocess.Popen([sys.executable, "-c", {waiter("VLLM::EngineCore")!r}], stdin=pipe, stdout=pipe)
engine.stdout.readline()
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("up", flush=True)
while not done.is_set():
    sum(range(1000))
engine.stdin.close(); engine.wait()
"""
SLEEPER = waiter("asyncrl: sleeper [test]")


def test_roles_come_from_titles_and_an_engine_core_is_named_after_its_owner():
    assert role("asyncrl: sampler0 [grpo-20261207-101500]") == "sampler0"
    assert role("asyncrl: launch grpo_countdown.py") == "launch grpo_countdown.py"
    assert role("VLLM::EngineCore", "asyncrl: sampler1 [run]") == "sampler1 engine"
    assert role("VLLM::EngineCore", "python3 serve.py") == "VLLM::EngineCore"
    assert role("python3 -m pytest") == ""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_busy_process_counts_its_cpu_and_a_sleeping_one_none():
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for code in (SPINNER, SLEEPER)
    ]
    try:
        for p in procs:
            assert p.stdout.readline() == b"up\n"
        cpu = ProcessCpu(interval_s=0.1)
        start = time.time()
        time.sleep(1.5)
        cpu.close()
        cores = cpu.cores(start, time.time())
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(10)
    # a busy loop gets at least a share of a core even on a loaded 2-core machine; a process
    # blocked on a read uses next to none
    assert cores["spinner"] > 0.2
    assert cores["sleeper"] < 0.05
    assert cores["spinner engine"] < 0.05
    assert list(cores)[0] == "spinner"  # highest first
