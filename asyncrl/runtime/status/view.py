"""What ``asyncrl status`` prints: a table for people (``format_status``), JSON for programs
(``reply_json``; actor states as their string values)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from asyncrl.runtime.status.schema import StatusReply


def local_time(unix_s: float) -> str:
    """``unix_s`` as local "YYYY-mm-dd HH:MM:SS"."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _first_line(text: str | None, width: int = 72) -> str:
    if not text:
        return "-"
    line = text.strip().splitlines()[0] if text.strip() else "-"
    return line if len(line) <= width else line[: width - 3] + "..."


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_status(reply: StatusReply) -> str:
    """The human-readable view ``asyncrl status`` prints."""
    lines = [
        f"run         {reply.run_dir}",
        f"supervisor  pid {reply.pid} on {reply.hostname}, up {_duration(reply.uptime_s)} "
        f"(since {local_time(reply.started_at)})",
    ]
    for n in reply.nodes:
        lines.append(
            f"node {n.rank:<6} {n.hostname} {n.address}, devices {n.devices_free}/{n.devices_total} free, {n.state}"
        )
    lines.append("")
    rows = [["ACTOR", "NODE", "STATE", "PID", "RESTARTS", "HEARTBEAT", "ERROR"]]
    for a in reply.actors:
        beat = f"{a.last_heartbeat_age_s:.1f}s ago" if a.last_heartbeat_age_s is not None else "-"
        rows.append(
            [
                a.name,
                str(a.node),
                a.state.value,
                str(a.pid) if a.pid is not None else "-",
                f"{a.restarts}/{a.max_restarts}",
                beat,
                _first_line(a.error),
            ]
        )
    lines += _table(rows) if reply.actors else ["(no actors)"]
    if reply.progress or reply.progress_error:
        lines += ["", "progress"]
        width = max((len(k) for k in reply.progress), default=0)
        lines += [f"  {k:<{width}}  {_value(k, v)}" for k, v in reply.progress.items()]
        if reply.progress_error:
            lines.append(f"  (progress unavailable: {reply.progress_error})")
    return "\n".join(lines)


def _value(key: str, v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and key.endswith("_at") and v > 0:
        return local_time(v)  # a progress key named *_at holds a Unix time
    if isinstance(v, float):
        return f"{v:.4f}".rstrip("0").rstrip(".") if 1e-3 <= abs(v) < 1e15 else f"{v:.3g}"
    if isinstance(v, (dict, list)):
        return msgspec.json.encode(v).decode()
    return str(v)


def reply_json(reply: StatusReply) -> str:
    return msgspec.json.format(msgspec.json.encode(reply), indent=2).decode()
