"""One trained episode of a run, as ``asyncrl show RUN_DIR`` prints it from ``RUN_DIR/episodes.jsonl``
(written by the driver, ``rl/observe/episodes_log.py``): the prompt, then each piece of the
episode on a line of its own, ``model`` for the tokens in the loss (mask 1) and ``env`` for an
environment's (mask 0, context), the text quoted so that spaces and newlines show."""

from __future__ import annotations

import json
from typing import Any

from asyncrl.rl.view.history import RunHistoryError, read_jsonl

EPISODES_FILE = "episodes.jsonl"


def read_episodes(run_dir: str) -> list[dict[str, Any]]:
    """The records of RUN_DIR/episodes.jsonl in order (a line cut short while written is skipped);
    `RunHistoryError` when there is no such file."""
    return read_jsonl(
        run_dir,
        EPISODES_FILE,
        lambda record: isinstance(record.get("step"), int) and isinstance(record.get("pieces"), list),
    )


def episode_text(run_dir: str, step: int | None = None) -> str:
    """The episode recorded at ``step`` (None: the last one), as lines to print."""
    records = read_episodes(run_dir)
    if not records:
        raise RunHistoryError(f"{run_dir}: {EPISODES_FILE} holds no episode yet")
    if step is None:
        record = records[-1]
    else:
        record = next((r for r in reversed(records) if r["step"] == step), None)
        if record is None:
            raise RunHistoryError(
                f"{run_dir}: no episode of step {step}; {EPISODES_FILE} has steps "
                f"{records[0]['step']} to {records[-1]['step']}"
            )
    verdict = {True: ", correct", False: ", not correct"}.get(record.get("correct"), "")
    lines = [
        f"step {record['step']}: group {record.get('group', '?')} from {record.get('sampler', '?')} "
        f"(weights v{record.get('version', '?')}), reward {record.get('reward', float('nan')):.3f}{verdict}; "
        f"{record.get('tokens', '?')} of its {record.get('completion_tokens', '?')} tokens in the loss",
        f"  prompt  {json.dumps(record.get('prompt', ''), ensure_ascii=False)}",
    ]
    for piece in record["pieces"]:
        who = "model " if piece.get("mask") else "env   "
        lines.append(
            f"  {who}  {json.dumps(piece.get('text', ''), ensure_ascii=False)}  ({piece.get('tokens', '?')} tokens)"
        )
    return "\n".join(lines)
