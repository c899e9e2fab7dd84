"""The README's first command must keep working: run the example through `asyncrl launch`."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hello_actors_example_runs_under_launch():
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", os.path.join(ROOT, "examples", "hello_actors.py")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "square: [0.0, 0.5, 2.0, 4.5]" in out.stdout
    assert "countdown: [5, 4, 3, 2, 1]" in out.stdout
    assert "as expected: actor 'squarer-1': died (killed by SIGKILL)" in out.stdout
    assert "after restart: [0.5, 0.5] 1 restart(s)" in out.stdout
