"""One trained episode of a run, as ``asyncrl show RUN_DIR`` prints it from ``RUN_DIR/episodes.jsonl``
(written by the driver, ``rl/observe/episodes_log.py``): the prompt, then each piece of the
episode on a line of its own, ``model`` for the tokens in the loss (mask 1) and ``env`` for an
environment's (mask 0, context), the text quoted so that spaces and newlines show; with ``ids``
(a run that kept them: ``--run.episode_ids``) under each its token ids and the model's sampling
log-probs."""

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


def episode_text(run_dir: str, step: int | None = None, episode: int = 0, ids: bool = False) -> str:
    """Episode ``episode`` recorded at ``step`` (None: the last step), as lines to print; ``ids``:
    with its token ids and log-probs (`RunHistoryError` where the run kept none)."""
    records = read_episodes(run_dir)
    if not records:
        raise RunHistoryError(f"{run_dir}: {EPISODES_FILE} holds no episode yet")
    step = records[-1]["step"] if step is None else step
    # the last records of that step: a resumed run writes a step again after cutting the file back
    at = [r for r in records if r["step"] == step]
    if not at:
        raise RunHistoryError(
            f"{run_dir}: no episode of step {step}; {EPISODES_FILE} has steps "
            f"{records[0]['step']} to {records[-1]['step']}"
        )
    kept = {r.get("episode", 0): r for r in at}
    if episode not in kept:
        raise RunHistoryError(f"{run_dir}: step {step} kept episodes 0 to {max(kept)} (--run.episodes), not {episode}")
    record = kept[episode]
    if ids and "completion_ids" not in record:
        raise RunHistoryError(
            f"{run_dir}: the run kept no token ids (--run.episode_ids true keeps them); "
            f"asyncrl show without --ids prints the text"
        )
    correct = record.get("correct")
    verdict = {True: ", correct", False: ", not correct"}.get(correct, "") if isinstance(correct, bool) else ""
    which = f" episode {episode} of {len(kept)}" if len(kept) > 1 else ""
    lines = [
        f"step {record['step']}{which}: group {record.get('group', '?')} from {record.get('sampler', '?')} "
        f"(weights v{record.get('version', '?')}), reward {record.get('reward', float('nan')):.3f}{verdict}; "
        f"{record.get('tokens', '?')} of its {record.get('completion_tokens', '?')} tokens in the loss",
        f"  prompt  {json.dumps(record.get('prompt', ''), ensure_ascii=False)}",
    ]
    if ids:
        lines.append(f"          ids {record.get('prompt_ids')}")
    at_token = 0
    for piece in record["pieces"]:
        who = "model " if piece.get("mask") else "env   "
        lines.append(
            f"  {who}  {json.dumps(piece.get('text', ''), ensure_ascii=False)}  ({piece.get('tokens', '?')} tokens)"
        )
        if ids:
            end = at_token + int(piece.get("tokens", 0))
            lines.append(f"          ids {record['completion_ids'][at_token:end]}")
            if piece.get("mask"):  # context has no sampling log-prob (0.0 by convention)
                lps = ", ".join(f"{v:.4f}" for v in record["logprobs"][at_token:end])
                lines.append(f"          logprobs [{lps}]")
            at_token = end
    return "\n".join(lines)
