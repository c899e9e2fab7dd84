"""A task's demonstrations (`Task.demonstration`) as the warm start's training rows: token ids and
labels laid out as the model meets them in an episode, so that supervised training teaches the
turns GRPO will sample.

Each piece is tokenized on its own, as an episode's prompt, model turns and replies are; labels
cover the model's text only (-100 on the prompt, an environment's replies and padding). A
``str`` demonstration is one model turn; an `Environment` may give its turns alternating with its
replies; an `Agent`'s is a list of OpenAI messages, rendered through the endpoint's own
``render_chat`` (``rl/agents/chat.py``) exactly as its episodes are.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from asyncrl.rl.model.evaluation import check_stop
from asyncrl.rl.model.policy import PromptFormat
from asyncrl.rl.tasks.agent import Agent
from asyncrl.rl.tasks.base import Environment, Task, TaskError, as_prompt


def demonstration_rows(
    tokenizer,
    task: Task,
    problems: Sequence[Any],
    max_positions: int,
    stop: threading.Event | None = None,
):
    """Right-padded ``ids``, ``labels`` (-100 on the prompt, an environment's replies and padding)
    and lengths of each problem's compact prompt + demonstration (its turns, each model turn
    ending as in an episode: eos, unless it ends on one of the environment's stop strings),
    for the problems of ``task`` that have a demonstration; and the longest model turn in tokens
    (the eos counted). Each piece is tokenized on its own, as an episode's prompt, model turns and
    replies are."""
    fmt = PromptFormat("compact", tokenizer, [tokenizer.eos_token_id], 1)
    rows, longest_turn = [], 0
    for i, problem in enumerate(problems):
        if i % 1000 == 0:  # 20 000 problems take seconds
            check_stop(stop)
        demonstration = task.demonstration(problem)
        if demonstration is None:
            continue
        if isinstance(task, Agent):
            ids, labels, turn = agent_demonstration_row(tokenizer, task, demonstration)
            rows.append((ids, labels))
            longest_turn = max(longest_turn, turn)
            continue
        ids = tokenizer(_compact_prompt(task, fmt, problem), add_special_tokens=False)["input_ids"]
        labels = [-100] * len(ids)
        for j, text in enumerate(_turns(task, demonstration)):
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            if j % 2:  # the environment's reply: context, never a target
                labels += [-100] * len(tokens)
            else:
                # Each model turn ends as an episode's does (tasks/episodes.py keeps the turn's
                # tokens, the stop token included, before the reply): eos, unless the turn ends on
                # one of the environment's stop strings, where generation stops without one.
                tokens = tokens + [tokenizer.eos_token_id] * (not _ends_on_stop_string(task, text))
                labels += tokens
                longest_turn = max(longest_turn, len(tokens))
            ids += tokens
        rows.append((ids, labels))
    if not rows:
        raise TaskError(
            f"task {task.task_name()}: no demonstrations (demonstration() returned None for all "
            f"{len(problems)} training problems): the embedded model is warm-started on them; "
            "define demonstration() or give a checkpoint with --model_path"
        )
    longest = max(len(ids) for ids, _ in rows)
    if longest > max_positions:
        raise ValueError(
            f"a training sequence of task {task.task_name()} has {longest} tokens, more than "
            f"max_positions={max_positions}; raise --model.max_positions or shorten the prompts "
            "and demonstrations"
        )
    batch_ids = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
    batch_labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    lengths = torch.empty(len(rows), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        batch_ids[i, : len(row_ids)] = torch.tensor(row_ids)
        batch_labels[i, : len(row_labels)] = torch.tensor(row_labels)
        lengths[i] = len(row_ids)
    return batch_ids, batch_labels, lengths, longest_turn


def agent_demonstration_row(tokenizer, task: Agent, conversation: Any) -> tuple[list[int], list[int], int]:
    """The ids and labels of an agent's demonstration (OpenAI messages, the model's turns as
    ``assistant`` ones), laid out as the endpoint lays out its episodes: before each assistant
    message, the prompt the endpoint would render for the conversation so far (context, no labels);
    the message's own tokens, rendered after it through the same template, as labels. A
    conversation whose next prompt does not extend the tokens before it would be separate
    samples in an episode: a `TaskError`, since its turns would not teach what they show."""
    from asyncrl.rl.agents.chat import ChatRequestError, render_chat

    name = task.task_name()
    if (
        not isinstance(conversation, list)
        or not conversation
        or not all(isinstance(m, dict) for m in conversation)
        or not any(m.get("role") == "assistant" for m in conversation)
    ):
        raise TaskError(
            f"agent {name}: demonstration() must return a list of OpenAI messages with at least one "
            f"assistant message (the model's turns), not {conversation!r:.120}"
        )
    ids: list[int] = []
    labels: list[int] = []
    longest = 0
    try:
        for k, message in enumerate(conversation):
            if message.get("role") != "assistant":
                continue
            prompt = render_chat(tokenizer, conversation[:k], None)
            whole = render_chat(tokenizer, conversation[: k + 1], None, generation_prompt=False)
            if prompt[: len(ids)] != ids or whole[: len(prompt)] != prompt:
                raise TaskError(
                    f"agent {name}: the chat template does not render its demonstration {conversation!r:.120} "
                    f"as one growing conversation (message {k} changes what comes before it)"
                )
            labels += [-100] * (len(prompt) - len(ids)) + whole[len(prompt) :]
            longest = max(longest, len(whole) - len(prompt))
            ids = whole
    except ChatRequestError as exc:
        raise TaskError(f"agent {name}: its demonstration cannot be rendered: {exc}") from None
    return ids, labels, longest


def _compact_prompt(task: Task, fmt: PromptFormat, problem: Any) -> str:
    """The problem's prompt as the embedded model reads it: `Prompt.compact` (a ``str`` prompt as is)."""
    prompt = as_prompt(task.prompt(problem))
    if not prompt.compact:
        raise TaskError(
            f"task {task.task_name()}: the embedded model reads one line of text, and prompt() "
            "returned messages without a compact form: return a str, or a Prompt with compact=..., "
            "or give a checkpoint with a chat template with --model_path"
        )
    return fmt.render_text(prompt)


def _turns(task: Task, demonstration: Any) -> list[str]:
    """A demonstration as its turns, the model's first and last: a ``str`` is one model turn; an
    environment may give a list alternating model and environment turns."""
    if isinstance(demonstration, str):
        return [demonstration]
    if not isinstance(task, Environment):
        raise TaskError(
            f"task {task.task_name()}: demonstration() must return a str or None (a list of turns "
            f"is for an Environment), not {type(demonstration).__name__}"
        )
    if (
        not isinstance(demonstration, list)
        or len(demonstration) % 2 == 0
        or not all(isinstance(t, str) for t in demonstration)
    ):
        raise TaskError(
            f"environment {task.task_name()}: demonstration() must return a str or a list of str of "
            f"odd length (model, environment, ..., model), not {demonstration!r:.120}"
        )
    return demonstration


def _ends_on_stop_string(task: Task, turn: str) -> bool:
    """Whether a demonstrated model turn ends on one of the environment's stop strings; a
    `TaskError` if one occurs earlier in it, since generation would have ended the turn there."""
    stops = [s for s in getattr(task, "stop", ()) if s] if isinstance(task, Environment) else []
    for s in stops:
        at = turn.find(s)
        if 0 <= at < len(turn) - len(s):
            raise TaskError(
                f"environment {task.task_name()}: a demonstrated turn holds the stop string {s!r} before "
                f"its end, where an episode's turn would end: {turn!r:.120}; split it into two turns"
            )
    return any(turn.endswith(s) for s in stops)
