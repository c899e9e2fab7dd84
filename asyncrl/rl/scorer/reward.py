"""A reward model's scores: a sequence-classification checkpoint with one scalar output, read at
each sequence's last token (prompt + completion), as a `ScorerActor` of kind "reward" serves them
(`RewardScorer`).

The scalar is taken from the decoder's hidden state at the last real token of each right-padded
row, through the checkpoint's ``score`` head (Llama, Qwen2, Mistral, Gemma's families), rather
than by transformers' pooling, which finds the last token by the pad id and so misreads a
completion that ends with a token equal to it (a tokenizer whose pad is its end token).
"""

from __future__ import annotations

import torch

from asyncrl.rl.scorer.base import Scored
from asyncrl.rl.scoring.batch import ScoreRequest


class RewardModelError(ValueError):
    """The checkpoint is not a reward model this scorer can read; the message says why."""


def load_reward_model(path: str, device: torch.device):
    """The sequence-classification model at ``path``, in eval mode, on ``device``."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path, local_files_only=True, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    if model.config.num_labels != 1:
        raise RewardModelError(
            f"{path}: a reward model has one output (num_labels 1), this one has {model.config.num_labels}"
        )
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise RewardModelError(
            f"{path}: no linear `score` head (the Llama/Qwen2/Mistral families' "
            f"sequence-classification layout); {type(model).__name__} is not read"
        )
    return model.to(device).eval().requires_grad_(False)


@torch.no_grad()
def sequence_rewards(
    model, requests: list[ScoreRequest], budget: int, device: torch.device
) -> tuple[list[list[float]], int]:
    """One score per completion of each ``(prompt, completions)`` request, and the forwards it
    took: rows of prompt + completion, right-padded, at most ``budget`` padded tokens a forward."""
    rows = [
        (r, j, prompt + completion)
        for r, (prompt, completions) in enumerate(requests)
        for j, completion in enumerate(completions)
    ]
    rows.sort(key=lambda row: len(row[2]))  # similar lengths together: less padding
    out = [[0.0] * len(completions) for _, completions in requests]
    body = getattr(model, model.base_model_prefix)
    forwards, start = 0, 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and len(rows[end][2]) * (end + 1 - start) <= budget:
            end += 1
        chunk = rows[start:end]
        width = len(chunk[-1][2])
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, (_, _, seq) in enumerate(chunk):
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
        ids, attention = ids.to(device), attention.to(device)
        hidden = body(input_ids=ids, attention_mask=attention).last_hidden_state
        last = attention.sum(dim=1) - 1
        scores = model.score(hidden[torch.arange(len(chunk), device=device), last]).squeeze(-1).float().tolist()
        for (r, j, _), score in zip(chunk, scores):
            out[r][j] = score
        forwards += 1
        start = end
    return out, forwards


class RewardScorer:
    """The reward model at ``model_path`` on ``device``: one scalar per completion."""

    kind = "reward"
    endpoint = "rewards"
    vocabulary = "the reward model's vocabulary of {n}: reward model and student tokenizers differ"

    def __init__(self, model_path: str, device: torch.device):
        self.device = device
        self.model = load_reward_model(model_path, device)
        self.vocab = int(self.model.get_input_embeddings().weight.shape[0])

    def score(self, requests: list[ScoreRequest], budget: int) -> Scored:
        rewards, forwards = sequence_rewards(self.model, requests, budget, self.device)
        return Scored(rewards, forwards)
