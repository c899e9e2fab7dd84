"""Solve rates of a policy on a task's problems, sampled or greedy, with transformers' ``generate``
(the warm start's check and the trainer's held-out evaluation).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from asyncrl.errors import AsyncrlError
from asyncrl.rl.model.policy import PromptFormat
from asyncrl.rl.tasks.base import Task
from asyncrl.rl.tasks.countdown import CountdownTask

_COUNTDOWN = CountdownTask()


class StoppedError(AsyncrlError):
    """A warm start or an evaluation was stopped (its ``stop`` event set) before it finished."""


def check_stop(stop: threading.Event | None, what: str = "the warm start of the default model") -> None:
    if stop is not None and stop.is_set():
        raise StoppedError(f"{what} was stopped before it finished")


@torch.no_grad()
def solve_rate(model, tokenizer, fmt: PromptFormat, problems: Sequence[Any], *, greedy: bool = True,
               n: int = 1, max_new_tokens: int | None = None, batch_size: int = 64, temperature: float = 1.0,
               stop: threading.Event | None = None, task: Task = _COUNTDOWN) -> float:
    """Fraction of ``n`` completions per problem of ``task`` (Countdown unless named) that its
    ``score`` finds correct.

    Batched, left-padded ``model.generate``; greedy decoding, or pure sampling at ``temperature``
    (no top-k / top-p: the distribution GRPO samples from). ``stop``: checked before each batch;
    once set, raises `StoppedError`.
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, not {n} and {batch_size}")
    if greedy and n > 1:
        raise ValueError("greedy decoding gives the same completion n times; use n=1 or greedy=False")
    if not problems:
        return 0.0
    jobs = [p for p in problems for _ in range(n)]
    correct = 0
    for i in range(0, len(jobs), batch_size):
        check_stop(stop)
        chunk = jobs[i:i + batch_size]
        texts = _generate(model, tokenizer, fmt, chunk, greedy, max_new_tokens or fmt.max_new_tokens_hint, temperature,
                          task)
        correct += sum(task.score(p, t).correct for p, t in zip(chunk, texts))
    return correct / len(jobs)


def _generate(model, tokenizer, fmt: PromptFormat, problems: Sequence[Any], greedy: bool, max_new_tokens: int,
              temperature: float, task: Task = _COUNTDOWN) -> list[str]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fmt.stop_token_ids[0]
    prompts = [fmt.render_ids(task.prompt(p)) for p in problems]
    width = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every completion starts at column `width`
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=not greedy,
                         max_new_tokens=max_new_tokens, eos_token_id=fmt.stop_token_ids, pad_token_id=pad,
                         **sampling)
    texts = []
    for row in out[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in fmt.stop_token_ids), len(row))
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return texts
