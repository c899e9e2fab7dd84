"""``RUN_DIR/episodes.jsonl``: one trained episode per step, decoded, with what the loss saw of it.

Masks are otherwise invisible: metrics.jsonl's ``tokens`` (in the loss) against
``completion_tokens`` (after the prompts) is the only sign that an environment's replies are left
out. Each step's record here is the first completion of the first group trained, its tokens
decoded in runs of one mask value: ``pieces`` alternate the model's text (``"mask": 1``, trained
on) and the environment's (``"mask": 0``, context), special tokens (a turn's eos) shown. The
record is written with the step's metrics, and cut back with them on a resume; ``asyncrl show
RUN_DIR [--step N]`` prints one (``rl/view/episodes.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.view.episodes import EPISODES_FILE


def episode_record(step: int, group: RolloutGroup, tokenizer: Any, index: int = 0) -> dict[str, Any]:
    """Completion ``index`` of ``group`` as the record of ``step`` (see the module docstring)."""
    ids = group.completion_ids[index]
    mask = group.action_mask[index] if group.action_mask else [1] * len(ids)
    pieces: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            pieces.append({"mask": int(mask[start]), "text": _decode(tokenizer, ids[start:end]), "tokens": end - start})
            start = end
    record = {
        "step": step,
        "group": group.uid,
        "sampler": group.sampler,
        "version": group.version,
        "reward": group.rewards[index],
        "prompt": _decode(tokenizer, group.prompt_ids),
        "completion_tokens": len(ids),
        "tokens": int(sum(mask)),
        "pieces": pieces,
    }
    if group.correct:
        record["correct"] = bool(group.correct[index])
    return record


class EpisodeLog:
    """Appends each step's record to ``RUN_DIR/episodes.jsonl``, decoding with the tokenizer of
    the policy at ``model_path``. `load` it first (a second or so: off the event loop); without
    it (no ``model_path``, or a tokenizer that did not load, said in one line) nothing is written:
    the run does not need the file."""

    def __init__(self, run_dir: str, model_path: str, log):
        self.path, self.model_path, self.log = os.path.join(run_dir, EPISODES_FILE), model_path, log
        self._tokenizer: Any = None

    def load(self) -> None:
        from asyncrl.rl.model.policy import load_prompt_format

        if not self.model_path:
            return
        try:
            self._tokenizer, _ = load_prompt_format(self.model_path)
        except Exception as exc:  # noqa: BLE001 - the file is a view: no reason to stop the run
            exc = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.log(f"{EPISODES_FILE}: not written, the tokenizer of {self.model_path} did not load ({exc})")

    def write(self, step: int, batch: list[RolloutGroup]) -> None:
        if self._tokenizer is None or not batch or not batch[0].completion_ids:
            return
        line = json.dumps(episode_record(step, batch[0], self._tokenizer), ensure_ascii=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
