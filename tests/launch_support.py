"""Running an example script the way a user does (``asyncrl launch``), for the tests of its errors."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_example(
    example: str, cwd, *args: str, timeout: float = 60, cache: str | None = None
) -> subprocess.CompletedProcess:
    """``asyncrl launch examples/<example> ARGS`` in ``cwd``, with one thread and a cache of its own
    (or ``cache``: conftest's ``model_cache``, shared by the session's runs)."""
    env = dict(os.environ, ASYNCRL_CACHE_DIR=cache or str(cwd / "cache"), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", os.path.join(ROOT, "examples", example), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tree(path) -> set[str]:
    """Every file and directory under ``path``, relative to it (to check that nothing was written)."""
    return {os.path.relpath(os.path.join(d, n), path) for d, dirs, files in os.walk(path) for n in dirs + files}
