"""The trainer actor: recomputes log-probs, takes GRPO steps, and sends its weights to the samplers.

It is rank 0 of the weight-sync group (`SyncMember` gives it the rendezvous endpoints) and the
only holder of an optimiser. A batch arrives as `RolloutGroup`s; each completion becomes one
sequence ``prompt + completion`` whose completion tokens are scored. Micro-batches are cut by a
token budget (padded tokens counted), and the loss is normalised by the whole batch's count, so
the accumulated gradient equals that of the full batch whatever the cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.comm.layout import DTYPES
from asyncrl.comm.member import SyncMember
from asyncrl.comm.weights import WeightSender
from asyncrl.rl.countdown import CountdownProblem
from asyncrl.rl.loss import GRPOLossConfig, group_advantages, grpo_loss, token_logprobs
from asyncrl.rl.rollout import RolloutGroup, validate_group
from asyncrl.runtime.actor import endpoint


from asyncrl.rl.sections import TrainerConfig  # noqa: E402  (torch-free: CLI --help and flag errors)

def trainer_config_from(fields: dict[str, Any]) -> TrainerConfig:
    """A `TrainerConfig` from plain values (as they cross the wire), the loss config nested."""
    values = dict(fields)
    if isinstance(values.get("loss"), dict):
        values["loss"] = GRPOLossConfig(**values["loss"])
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    return TrainerConfig(**values)


@dataclass
class _Sequences:
    """One micro-batch: right-padded ``prompt + completion`` rows and, per row, where the
    completion's scores sit in ``token_logprobs``' output (index ``prompt_len - 1 + j``)."""

    input_ids: torch.Tensor  # [B, L]
    attention: torch.Tensor  # [B, L]
    score_index: torch.Tensor  # [B, C] positions in the [B, L-1] log-prob matrix
    mask: torch.Tensor  # [B, C] completion token j exists
    behaviour: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]


def micro_batches(groups: list[RolloutGroup], advantages: torch.Tensor, budget: int, device: torch.device) -> list[_Sequences]:
    """Cut the batch's sequences into micro-batches of at most ``budget`` padded tokens (a single
    sequence longer than the budget goes alone)."""
    rows = []
    a = 0
    for g in groups:
        for ids, lps in zip(g.completion_ids, g.behaviour_logprobs):
            rows.append((g.prompt_ids, ids, lps, float(advantages[a])))
            a += 1
    rows.sort(key=lambda r: len(r[0]) + len(r[1]))  # similar lengths together: less padding
    out, chunk, longest = [], [], 0
    for row in rows:
        length = len(row[0]) + len(row[1])
        if chunk and max(longest, length) * (len(chunk) + 1) > budget:
            out.append(_pack(chunk, device))
            chunk, longest = [], 0
        chunk.append(row)
        longest = max(longest, length)
    if chunk:
        out.append(_pack(chunk, device))
    return out


def _pack(rows: list, device: torch.device) -> _Sequences:
    length = max(len(p) + len(c) for p, c, _, _ in rows)
    width = max(max(len(c) for _, c, _, _ in rows), 1)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    score_index = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    behaviour = torch.zeros(len(rows), width)
    for i, (prompt, completion, lps, _) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        c = len(completion)
        score_index[i, :c] = torch.arange(len(prompt) - 1, len(prompt) - 1 + c)
        mask[i, :c] = True
        behaviour[i, :c] = torch.tensor(lps)
    advantages = torch.tensor([r[3] for r in rows])
    return _Sequences(*(t.to(device) for t in (ids, attention, score_index, mask, behaviour, advantages)))


class TrainerActor(SyncMember):
    """Holds the policy and its optimiser; rank 0 of the weight-sync group."""

    def __init__(self, model_path: str, config: dict = {}, *, device: str = "cpu", seed: int = 0):
        from asyncrl.rl.model import load_policy  # transformers is heavy: import in the actor only

        torch.manual_seed(seed)
        self.config = trainer_config_from(config)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", 0)  # the actor sees only its own GPU
            torch.cuda.set_device(self.device)
        self.model_path = model_path
        self.model, self.tokenizer, self.fmt = load_policy(model_path, self.device, torch.float32)
        self.model.train()
        self.ref = None
        if self.config.loss.kl_coef > 0:
            self.ref, _, _ = load_policy(model_path, self.device, torch.float32)
            self.ref.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, betas=self.config.betas,
                                           weight_decay=self.config.weight_decay)
        self.sender: WeightSender | None = None
        self.steps = 0

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @endpoint
    async def setup_sender(self, timeout_s: float = 60.0, bucket_bytes: int = 0, wire_dtype: str = "") -> int:
        """After `form_group`: agree on the layout with every sampler. ``wire_dtype`` (e.g.
        "bfloat16") is the samplers' parameter dtype when it differs from the trainer's fp32.
        Returns the bucket count."""
        cast = DTYPES[wire_dtype] if wire_dtype else None
        self.sender = await asyncio.to_thread(WeightSender.create, self.sync_comm, self.sync_group,
                                              self.weight_tensors(), bucket_bytes=bucket_bytes or None,
                                              timeout_s=timeout_s, wire_dtype=cast)
        return len(self.sender.layout.buckets)

    @endpoint
    async def send_weights(self, version: int) -> float:
        """Broadcast the current weights as ``version``; returns the seconds the sync took."""
        stats = await asyncio.to_thread(self.sender.send, version)
        return stats.seconds

    @endpoint
    async def train_step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One optimiser step on ``groups``; returns the step's metrics."""
        for g in groups:
            validate_group(g)
        return await asyncio.to_thread(self._train_step, groups)

    def _train_step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        start = time.perf_counter()
        cfg = self.config
        advantages = group_advantages([list(g.rewards) for g in groups], cfg.normalize_std)
        batches = micro_batches(groups, advantages, cfg.micro_batch_tokens, self.device)
        n_tokens = float(sum(int(b.mask.sum()) for b in batches))
        n_seqs = float(sum(int(b.mask.any(dim=1).sum()) for b in batches))
        normalizer = max(n_tokens if cfg.loss.aggregation == "token_mean" else n_seqs, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for batch in batches:
            metrics = self._accumulate(batch, normalizer)
            weight = float(batch.mask.sum()) / max(n_tokens, 1.0)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (float(v) if k in ("loss", "pg_loss") else float(v) * weight)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.steps += 1
        sums.pop("tokens", None)
        sums.pop("ratio_max", None)
        sums.update(grad_norm=float(grad_norm), tokens=n_tokens, sequences=n_seqs, micro_batches=len(batches),
                    train_s=time.perf_counter() - start)
        return sums

    def _accumulate(self, batch: _Sequences, normalizer: float) -> dict[str, torch.Tensor]:
        cfg = self.config
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda" and cfg.bf16)
        with autocast:
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention).logits
        logits = logits.float() / cfg.temperature
        new = token_logprobs(logits, batch.input_ids).gather(1, batch.score_index)
        ref = None
        if self.ref is not None:
            with torch.no_grad(), autocast:
                ref_logits = self.ref(input_ids=batch.input_ids, attention_mask=batch.attention).logits
            ref = token_logprobs(ref_logits.float() / cfg.temperature, batch.input_ids).gather(1, batch.score_index)
        with torch.no_grad():  # entropy of the policy at the scored positions (a metric only)
            scored = logits[:, :-1].gather(1, batch.score_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            logp = torch.log_softmax(scored, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
        loss, metrics = grpo_loss(new, batch.behaviour, batch.advantages, batch.mask, cfg.loss,
                                  ref_logprobs=ref, entropy=entropy, normalizer=normalizer)
        loss.backward()
        return metrics

    @endpoint
    async def evaluate(self, problems: list[CountdownProblem], samples: int = 4, max_new_tokens: int = 0,
                       batch_size: int = 64) -> dict[str, float]:
        """Solve rate on ``problems``: greedy, and sampled at the training temperature
        (``samples`` completions per problem; 0 skips it)."""
        from asyncrl.rl.model import solve_rate

        limit = max_new_tokens or self.fmt.max_new_tokens_hint

        def run() -> dict[str, float]:
            self.model.eval()
            try:
                out = {"greedy": solve_rate(self.model, self.tokenizer, self.fmt, problems, greedy=True,
                                            max_new_tokens=limit, batch_size=batch_size)}
                if samples:
                    out["sampled"] = solve_rate(self.model, self.tokenizer, self.fmt, problems, greedy=False,
                                                n=samples, max_new_tokens=limit, batch_size=batch_size,
                                                temperature=self.config.temperature)
                return out
            finally:
                self.model.train()

        return await asyncio.to_thread(run)

    @endpoint
    async def save_checkpoint(self, run_dir: str, step: int, keep: int, run_state: bytes) -> str:
        """Write the resumable checkpoint of ``step`` under ``run_dir`` (policy, optimiser, RNGs
        and the driver's ``run_state`` JSON), atomically, keeping the newest ``keep``; returns
        its path. See `checkpoint.py`."""
        from asyncrl.rl.checkpoint import write_checkpoint

        extra = os.path.join(self.model_path, "asyncrl_model.json")
        return await asyncio.to_thread(write_checkpoint, run_dir, step, keep, self.model, self.tokenizer,
                                       self.optimizer, self.steps, run_state,
                                       [extra] if os.path.exists(extra) else [])

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        """Take the policy, optimiser state and RNG states of the checkpoint at ``path`` (before
        the weight-sync group is formed); returns the trainer's step count there."""
        from asyncrl.rl.checkpoint import Checkpoint, load_trainer_state
        from asyncrl.rl.model import load_policy

        def load() -> int:
            checkpoint = Checkpoint(-1, path)
            model, _, _ = load_policy(checkpoint.model_dir, self.device, torch.float32)
            self.model = model.train()
            cfg = self.config
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                               weight_decay=cfg.weight_decay)
            self.steps = load_trainer_state(checkpoint, self.optimizer)
            self.sender = None  # it held the old parameters: set up again with the group
            return self.steps

        return await asyncio.to_thread(load)

    @endpoint
    async def weights_digest(self) -> str:
        """SHA-256 of the policy's parameters as the samplers hold them (`checkpoint.tensor_digest`)."""
        from asyncrl.rl.checkpoint import tensor_digest

        return await asyncio.to_thread(tensor_digest, self.weight_tensors())

    @endpoint
    async def save(self, path: str, extra_files: dict[str, str] = {}) -> str:
        """Write the policy as a Hugging Face checkpoint directory (atomically: temp dir + rename),
        with ``extra_files`` (name -> text, e.g. best.json) inside it, written with the rest so
        they never describe another policy. A failed write (a full disk) leaves nothing behind
        and raises a one-line `CheckpointWriteError`."""
        from asyncrl.rl.checkpoint import write_failure

        def write() -> str:
            final = os.path.abspath(path)
            tmp, aside = f"{final}.tmp-{os.getpid()}", f"{final}.old-{os.getpid()}"
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                self.model.save_pretrained(tmp, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
                extra = os.path.join(self.model_path, "asyncrl_model.json")
                if os.path.exists(extra):
                    shutil.copy(extra, tmp)
                with open(os.path.join(tmp, "asyncrl_trainer.json"), "w") as f:
                    json.dump({"steps": self.steps, "config": dataclasses.asdict(self.config)}, f, indent=2)
                for name, text in extra_files.items():
                    with open(os.path.join(tmp, os.path.basename(name)), "w") as f:
                        f.write(text)
            except Exception as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise write_failure("the policy", final, exc) from exc
            # The old one is renamed aside before the new one takes its name, so a kill in between
            # leaves a whole policy under one of the two names, never a half-deleted one.
            if os.path.exists(final):
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
            return final

        return await asyncio.to_thread(write)
