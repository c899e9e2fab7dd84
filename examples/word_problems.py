"""The reward of the dataset example: arithmetic word problems from a JSONL file, exact answers.

    asyncrl launch examples/grpo.py --task.data examples/data/word_problems.jsonl \
        --task.reward examples/word_problems.py:reward

(docs/grpo.md, "Tasks: examples before/after", has the run's time and solve rates with the
defaults.)

Each row of the file (written by ``examples/data/make_word_problems.py``) has a ``prompt``, the
``answer`` (an int) and a ``demonstration`` (what the embedded model is warm-started on). The
policy answers with ``<answer>N</answer>``; anything may come before it (the demonstrations write
the sum first, ``12+7=<answer>19</answer>``). The completion is model text: it is matched with a
regular expression and converted with ``int``, never evaluated.
"""

from __future__ import annotations

import re

from asyncrl.rl.tasks.base import Score

_ANSWER = re.compile(r"<answer>\s*(-?\d{1,12})\s*</answer>")


def answer_value(completion: str) -> int | None:
    """The number in the last ``<answer>N</answer>`` of ``completion`` (digits, an optional minus), or None."""
    found = _ANSWER.findall(completion)
    return int(found[-1]) if found else None


def reward(row: dict, completion: str) -> Score:
    """1 for the row's exact ``answer`` (an int, or its digits as a string), else 0; the metric
    ``answered`` says whether there was an answer at all."""
    value = answer_value(completion)
    correct = value is not None and str(value) == str(row["answer"]).strip()
    return Score(1.0 if correct else 0.0, correct, {"answered": float(value is not None)})
