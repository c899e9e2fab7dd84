"""The janitor of a vLLM engine: what vLLM leaves outside its processes is removed, however the
sampler actor ends.

vLLM leaves ZeroMQ socket files (and, for a multi-process executor, a file store) in its temporary
directory even after a clean shutdown, and its shared-memory queues and multiprocessing semaphores
in ``/dev/shm`` when it is killed. `VLLMBackend` gives the engine a scratch directory of its own
and a `Janitor`, a small process outside the actor's process group, that removes both once the
actor is gone: a clean stop, a crash, or a SIGKILL of the actor or of the supervisor.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, cast

_JANITOR = """
import os, shutil, sys
names, pids = set(), set()
for line in sys.stdin:  # ends at EOF: the sampler actor closed the pipe, or died, whichever way
    for word in line.split():
        (pids.add(word[4:]) if word.startswith("pid:") else names.add(word))
# loky's semaphores (torch.compile's process pool) are named after the process that made them,
# which may do so at any time: those of the engine's processes, whenever they were made.
for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
    if name.startswith("sem.loky-") and name.split("-")[1] in pids:
        names.add(name)
# A multiprocessing semaphore's name says nothing of its maker: one that appeared while our engine
# started may be another engine's on a shared host, still in use. Leave what a living process other
# than ours maps (ours are dying with the actor, or dead). Compared by inode, not by name: glibc's
# sem_open maps a temporary file and links it to the semaphore's name, so /proc/PID/maps shows
# "/dev/shm/sem.XXXXXX (deleted)" for a semaphore, never its name.
in_use = set()
for entry in os.listdir("/proc"):
    if entry.isdigit() and entry not in pids and entry != str(os.getpid()):
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        in_use.add(line.split()[4])
        except (OSError, IndexError):
            pass
for name in sorted(names):
    path = os.path.join("/dev/shm", name)
    try:
        if str(os.stat(path).st_ino) not in in_use:
            os.unlink(path)
    except OSError:
        pass
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


class Janitor:
    """A small process in a session of its own (so the kill of the actor's process group spares
    it) that waits for the end of its stdin pipe, which only the actor holds, and then removes the
    engine's scratch directory and the shared-memory segments its processes had mapped. It covers
    every way the actor ends, SIGKILL included; after a clean shutdown there is nothing left for
    it but the directory."""

    def __init__(self, scratch: str):
        self.scratch = scratch
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _JANITOR, scratch],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        self.pipe = cast(IO[str], self.proc.stdin)  # stdin=PIPE, text=True: Popen made it

    def watch(self, shm_names: list[str]) -> None:
        """Add segments to remove, or ``pid:N`` for a process whose loky semaphores to remove (any
        number of calls; the janitor keeps them all)."""
        try:
            self.pipe.write(" ".join(shm_names) + "\n")
            self.pipe.flush()
        except (OSError, ValueError):  # finished already: too late to add any
            pass

    def follow(self, before: set[str], poll_s: float = 0.2) -> Callable[[], None]:
        """Watch the segments this process and its children create from now on (`engine_segments`),
        and the processes below this one (whose loky semaphores it removes however late they were
        made), every ``poll_s`` until the returned function is called (which watches once more),
        so that an actor killed while its engine starts (a start deadline, a fault) leaves none
        behind."""
        stop, sent = threading.Event(), set[str]()

        def scan() -> None:
            new = set(engine_segments(before)) | {f"pid:{pid}" for pid in _descendants(os.getpid())}
            new -= sent
            if new:
                self.watch(sorted(new))
                sent.update(new)

        def run() -> None:
            while not stop.wait(poll_s):
                scan()

        thread = threading.Thread(target=run, name="asyncrl-vllm-shm", daemon=True)
        thread.start()

        def done() -> None:
            stop.set()
            thread.join()
            scan()

        return done

    def finish(self) -> None:
        """Clean up now (after the engine shut down); waits for the janitor, briefly."""
        if self.pipe.closed:
            return
        try:
            self.pipe.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            shutil.rmtree(self.scratch, ignore_errors=True)


def keep_compile_cache(scratch: str, shared: str = "") -> None:
    """Keep torch.compile's cache out of the engine's scratch directory: a link in ``scratch``,
    named as torch names its cache directory in a temporary directory (``torchinductor_<user>``),
    to ``shared`` ("": the one torch uses in this process, whose temporary directory is still the
    real one). The engine's processes, whose ``TMPDIR`` is ``scratch``, then compile into and load
    from the same cache as every other process of this user, and the janitor removes the link
    only (``shutil.rmtree`` does not follow links).

    What it saves: vLLM's sampler compiles one small function with inductor on an engine's first
    generate (``batched_count_greater_than``: the rank of each sampled token, computed whenever
    log-probs are asked for, as the backend always does), and on CPU inductor first precompiles its
    C++ prefix header (a 150-MB ``.gch``) into that directory. In a fresh directory each engine
    rebuilt it, most of every engine's first generate on two cores, then removed with the scratch
    directory. Now the first engine on a machine builds it, and later ones load it (benchmarks/README.md,
    "A vLLM engine's first generate", has the figures)."""
    try:  # a private module of torch's (2.5 on): without it, the engine compiles as it did before
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return
    shared = shared or default_cache_dir()
    os.makedirs(shared, exist_ok=True)
    os.symlink(shared, os.path.join(scratch, os.path.basename(default_cache_dir())))


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - set(found)
        found += sorted(frontier)
    return found


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def engine_segments(before: set[str]) -> list[str]:
    """Shared memory that is ours: new since ``before`` and mapped by this process or one below
    it; or a new multiprocessing semaphore (mapped under a temporary name, so not attributable
    here: one of another engine is spared at the end by the janitor, which compares inodes)."""
    mapped = set(_shm_mapped_by([os.getpid(), *_descendants(os.getpid())]))
    return sorted(n for n in shm_names() - before if n in mapped or n.startswith("sem.mp-"))


def _shm_mapped_by(pids: list[int]) -> list[str]:
    """Names of the /dev/shm segments that ``pids`` have mapped (vLLM's shared-memory queues)."""
    names: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[5:] or [""]
                    if path[0].startswith("/dev/shm/"):
                        names.add(os.path.basename(path[0].removesuffix(" (deleted)")))
        except OSError:
            continue
    return sorted(n for n in names if n and "/" not in n)
