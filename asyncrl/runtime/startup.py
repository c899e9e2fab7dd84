"""``start_phase``: what a starting actor tells its supervisor, so that slow is not taken for hung.

The supervisor gives a new actor ``start_timeout_s`` to become ready. Some starts are slower than
any one number fits (a model loaded from a cold disk, vLLM compiling its graphs on a fresh GPU
machine), so an actor names each long step of its start, with how long that step may take::

    start_phase("building the vLLM engine", budget_s=900, knob="--sampler.engine_start_timeout_s")

Each report restarts the supervisor's start deadline: it becomes now + max(start_timeout_s,
budget_s). A start that overruns it fails naming the phase, how long it ran and ``knob``.

The report travels on the worker's heartbeat thread (its own socket), so it gets out even while
the constructor holds the event loop, and it may be made from any thread. Outside an actor's
process (an actor class used directly in a test), and once the actor is ready, it does nothing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

_Report = Callable[[str, float, str], None]

_lock = threading.Lock()
_report: _Report | None = None


def start_phase(phase: str, budget_s: float = 0.0, knob: str = "") -> None:
    """Tell the supervisor this actor's start is now in ``phase`` ("loading Qwen2.5-7B"), which
    may take ``budget_s`` seconds (0: the supervisor's ``start_timeout_s``); ``knob`` names the
    setting that raises ``budget_s``, for the error if the phase overruns it. Thread-safe; never
    blocks; a no-op outside a starting actor's process."""
    if not isinstance(phase, str) or not phase.strip():
        raise ValueError(f"phase must be a non-empty string, not {phase!r}")
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s >= 0):
        raise ValueError(f"budget_s must be a finite number >= 0, not {budget_s!r}")
    with _lock:
        report = _report
    if report is not None:
        report(phase.strip(), float(budget_s), knob)


def install(report: _Report | None) -> None:
    """The worker's side: ``report`` sends a phase to the supervisor (None: stop reporting, the
    actor is ready or gone)."""
    global _report
    with _lock:
        _report = report
