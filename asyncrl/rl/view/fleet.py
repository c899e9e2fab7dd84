"""The fleet of samplers in words, as the answer of ``asyncrl scale`` and the run's log line of a
scale give it (light: the CLI imports it without the driver)."""

from __future__ import annotations


def fleet_text(running: int, restarting: int, starting: int, target: int) -> str:
    """ "1 running, 98 starting (target 99)": the samplers whose process is up, those waiting for
    a restart and those starting (each only when there are some), and the target they go to."""
    parts = [f"{running} running"]
    parts += [f"{k} {what}" for k, what in ((restarting, "restarting"), (starting, "starting")) if k]
    return f"{', '.join(parts)} (target {target})"
