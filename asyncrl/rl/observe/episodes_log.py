"""``RUN_DIR/episodes.jsonl``: trained episodes of each step, decoded, with what the loss saw of them.

Masks are otherwise invisible: metrics.jsonl's ``tokens`` (in the loss) against
``completion_tokens`` (after the prompts) is the only sign that an environment's replies are left
out. Each step's records here are the first ``--run.episodes`` completions (1 by default) of the
groups trained, in order, numbered by ``episode``, their tokens decoded in runs of one mask value:
``pieces`` alternate the model's text (``"mask": 1``, trained on) and the environment's (``"mask":
0``, context), special tokens (a turn's eos) shown. With ``--run.episode_ids`` a record also keeps
the token ids, the mask and the sampling log-probs as the trainer got them (``prompt_ids``,
``completion_ids``, ``mask``, ``logprobs``), for debugging token-exactness. The records are written
with the step's metrics, and cut back with them on a resume; ``asyncrl show RUN_DIR [--step N]
[--episode K] [--ids]`` prints one (``rl/view/episodes.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.view.episodes import EPISODES_FILE


def episode_record(
    step: int, group: RolloutGroup, tokenizer: Any, index: int = 0, *, episode: int = 0, ids: bool = False
) -> dict[str, Any]:
    """Completion ``index`` of ``group`` as the record of ``step``'s ``episode`` (see the module
    docstring); ``ids``: with its token ids, mask and sampling log-probs."""
    tokens = group.completion_ids[index]
    mask = group.action_mask[index] if group.action_mask else [1] * len(tokens)
    pieces: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or mask[end] != mask[start]:
            text = _decode(tokenizer, tokens[start:end])
            pieces.append({"mask": int(mask[start]), "text": text, "tokens": end - start})
            start = end
    record = {
        "step": step,
        "episode": episode,
        "group": group.uid,
        "sampler": group.sampler,
        "version": group.version,
        "reward": group.rewards[index],
        "prompt": _decode(tokenizer, group.prompt_ids),
        "completion_tokens": len(tokens),
        "tokens": int(sum(mask)),
        "pieces": pieces,
    }
    if group.correct:
        record["correct"] = bool(group.correct[index])
    if ids:
        record["prompt_ids"] = list(group.prompt_ids)
        record["completion_ids"] = list(tokens)
        record["mask"] = [int(m) for m in mask]
        record["logprobs"] = list(group.behaviour_logprobs[index])
    return record


class EpisodeLog:
    """Appends each step's records to ``RUN_DIR/episodes.jsonl`` (``episodes`` a step, with their
    token ids where ``ids``), decoding with the tokenizer of the policy at ``model_path``. `load` it
    first (a second or so: off the event loop); without it (no ``model_path``, or a tokenizer that
    did not load, said in one line) nothing is written: the run does not need the file."""

    def __init__(self, run_dir: str, model_path: str, log, *, episodes: int = 1, ids: bool = False):
        self.path, self.model_path, self.log = os.path.join(run_dir, EPISODES_FILE), model_path, log
        self.episodes, self.ids = episodes, ids
        self._tokenizer: Any = None

    def load(self) -> None:
        if not self.model_path:
            return
        try:
            self._tokenizer = load_decoder(self.model_path)
        except Exception as exc:  # noqa: BLE001 - the file is a view: no reason to stop the run
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.log(f"{EPISODES_FILE}: not written, the tokenizer of {self.model_path} did not load ({why})")

    def write(self, step: int, batch: list[RolloutGroup]) -> None:
        """The records of ``step``: the first `episodes` completions of ``batch``, in order."""
        if self._tokenizer is None:
            return
        chosen = [(g, i) for g in batch for i in range(len(g.completion_ids))][: self.episodes]
        lines = [
            json.dumps(episode_record(step, g, self._tokenizer, i, episode=k, ids=self.ids), ensure_ascii=False)
            for k, (g, i) in enumerate(chosen)
        ]
        if lines:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))


def load_decoder(model_path: str) -> Any:
    """What decodes the policy's token ids: its ``tokenizer.json`` read by the ``tokenizers``
    library where it has one (a fast tokenizer's decode is that library's, and the driver then
    imports no transformers: seconds of a run's start on a small machine), else its tokenizer."""
    path = os.path.join(model_path, "tokenizer.json")
    if os.path.isfile(path):
        return Tokenizer.from_file(path)
    from asyncrl.rl.model.policy import load_prompt_format

    return load_prompt_format(model_path)[0]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
