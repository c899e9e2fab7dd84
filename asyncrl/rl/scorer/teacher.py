"""`TeacherScorer`: a teacher's per-token log-probs of completions the samplers made (on-policy
distillation), or with ``top_k`` its ``top_k`` most likely tokens at each position.

A pass is the trainer's own scoring (``scoring/``: the same micro-batches and `scored_logprobs`,
the fused output layer on a checkpoint that allows it), so a teacher's log-probs are computed
exactly as the trainer's KL reference's are, at the samplers' temperature."""

from __future__ import annotations

import torch

from asyncrl.rl.model.policy import load_policy
from asyncrl.rl.rollout import TeacherTopK
from asyncrl.rl.scorer.base import Scored
from asyncrl.rl.scoring.batch import ScoreRequest, request_batches
from asyncrl.rl.scoring.logprobs import fused_head_fallback, scored_logprobs, scored_topk


class TeacherScorer:
    """The causal LM at ``model_path`` on ``device``, scoring at ``temperature``; ``top_k`` > 0:
    its top ``top_k`` (clamped to its vocabulary) instead of the sampled tokens' log-probs."""

    kind = "teacher"
    vocabulary = "the teacher's vocabulary of {n}: teacher and student tokenizers differ"

    def __init__(self, model_path: str, device: torch.device, *, temperature: float, top_k: int = 0):
        self.device, self.temperature = device, temperature
        self.model, _, _ = load_policy(model_path, device, dtype=torch.bfloat16 if device.type == "cuda" else None)
        self.model.requires_grad_(False)
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.top_k = min(top_k, self.vocab)  # K >= the vocabulary: the whole distribution
        self.endpoint = "teacher_topk" if self.top_k else "teacher_logprobs"
        self.fused = not fused_head_fallback(self.model)
        self.autocast = torch.bfloat16 if device.type == "cuda" else None

    def score(self, requests: list[ScoreRequest], budget: int) -> Scored:
        """Per request, one answer per completion: its log-probs, or (top-K ids, their log-probs)
        flat and position-major, gathered into a `TeacherTopK`."""
        out: list[list] = [[None] * len(r.completion_ids) for r in requests]
        batches = request_batches(requests, budget, self.device)
        for batch, where in batches:
            lengths = [len(requests[r].completion_ids[j]) for r, j in where]
            if self.top_k:
                values, ids = scored_topk(
                    self.model, batch, self.temperature, self.top_k, fused=self.fused, autocast_dtype=self.autocast
                )
                for s, ((r, j), n) in enumerate(zip(where, lengths)):
                    out[r][j] = (ids[s, :n].flatten().tolist(), values[s, :n].flatten().tolist())
            else:
                logprobs, _ = scored_logprobs(
                    self.model, batch, self.temperature, fused=self.fused, autocast_dtype=self.autocast
                )
                for s, ((r, j), n) in enumerate(zip(where, lengths)):
                    out[r][j] = logprobs[s, :n].tolist()
        if self.top_k:
            answers = [TeacherTopK(self.top_k, [i for i, _ in row], [v for _, v in row]) for row in out]
            return Scored(answers, len(batches))
        return Scored(out, len(batches))
