"""The trainer actor: recomputes log-probs, takes GRPO steps, and sends its weights to the samplers.

It is rank 0 of the weight-sync group (`SyncMember` gives it the rendezvous endpoints). One
trainer may be N processes (``--trainer.world_size``): each call below is written once, and what
differs between one process and a rank of N (the batch's share, the guard, gathers, the
checkpoint's format) is the trainer's strategy, ``self.parallel`` (``trainer/parallel.py``). A
batch arrives as `RolloutGroup`s; each completion becomes one
sequence ``prompt + completion`` whose completion tokens are scored. Micro-batches are cut by a
token budget, padded tokens counted (``trainer/batching.py``; several sequences per row with
``pack_tokens``, ``trainer/packing.py``), and the loss (``trainer/loss.py``)
is normalised by the whole batch's count, so the accumulated gradient equals that of the full
batch whatever the cut. Checkpoints (and the saved policy) are written by ``trainer/checkpoint.py``; the
held-out evaluation is ``trainer/heldout.py``'s, and an out-of-memory error is worded by
``trainer/out_of_memory.py``. The weight-sync endpoints are `WeightSending`'s
(``trainer/weight_sending.py``), the checkpoint and save endpoints `CheckpointEndpoints`'
(``trainer/checkpoint_endpoints.py``).
"""

from __future__ import annotations

import contextlib
import time

import torch

from asyncrl.comm.weights import WeightSender
from asyncrl.rl.actor_device import actor_device
from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.config.trainer import TrainerConfig
from asyncrl.rl.model.tally import HeldoutPart
from asyncrl.rl.rollout import RolloutGroup, validate_group
from asyncrl.rl.scoring.batch import MicroBatch
from asyncrl.rl.scoring.logprobs import scored_logprobs, scored_logprobs_at
from asyncrl.rl.tasks.loading import TaskSpec
from asyncrl.rl.trainer.batching import micro_batches
from asyncrl.rl.trainer.checkpoint_endpoints import CheckpointEndpoints
from asyncrl.rl.trainer.compile import compile_layers, compiled
from asyncrl.rl.trainer.heldout import HeldoutEvaluation
from asyncrl.rl.trainer.loss import grpo_loss, loss_normalizer, step_advantages
from asyncrl.rl.trainer.out_of_memory import TrainerMemoryError, does_not_fit, micro_batch_error
from asyncrl.rl.trainer.packing import packed_micro_batches
from asyncrl.rl.trainer.parallel import Local
from asyncrl.rl.trainer.rank_member import RankMember
from asyncrl.rl.trainer.schedule import learning_rate, set_learning_rate
from asyncrl.rl.trainer.split import batch_counts
from asyncrl.rl.trainer.weight_sending import WeightSending
from asyncrl.runtime.actor import endpoint
from asyncrl.runtime.startup import start_phase

DEADLINE_S = 900.0
"""A call's deadline on a rank group when the driver names none (the default train step deadline)."""


class TrainerActor(RankMember, WeightSending, CheckpointEndpoints):
    """Holds the policy and its optimiser; rank 0 of the weight-sync group. ``task`` and ``data``
    give the held-out problems `evaluate` solves (the task is built here, from its spec)."""

    def __init__(
        self,
        model_path: str,
        config: TrainerConfig = TrainerConfig(),
        *,
        device: str = "cpu",
        seed: int = 0,
        task: TaskSpec | None = None,
        data: DataConfig = DataConfig(),
    ):
        task = TaskSpec("countdown") if task is None else task  # built per call: its options are a dict
        torch.manual_seed(seed)
        self.seed = seed
        self.config = config
        self.heldout = HeldoutEvaluation(task, data)
        # None is "the samplers' temperature"; a GRPO run resolves it (GRPOConfig.trainer_config),
        # a trainer used on its own scores at 1, sampling's default.
        self.temperature = 1.0 if config.temperature is None else config.temperature
        self.device = actor_device(device)
        self.parallel = Local()  # a rank group's `Sharded` once `rank_join` shards the policy
        self.model_path = model_path
        start_phase(f"loading the policy {model_path}")
        try:
            self.model, self.tokenizer, self.fmt = self._policy()
            # The KL term's reference: the starting policy. With LoRA that is the frozen base already
            # in memory (the adapters switched off, `_reference`), so no copy is loaded.
            self.ref = None
            if self.config.loss.kl_coef > 0 and not self.config.lora.rank:
                start_phase("loading the KL reference (a second copy of the policy)")
                self.ref, _, _ = self._load_policy(model_path)
                self.ref.eval().requires_grad_(False)
        except torch.OutOfMemoryError as exc:
            raise self._does_not_fit(
                "the policy" + (" and its KL reference" if config.loss.kl_coef else ""), exc
            ) from None
        self.optimizer = self._new_optimizer()
        self.sender: WeightSender | None = None
        self.steps = 0
        self._auto_tokens = 0  # --trainer.micro_batch_tokens 0 once resolved (`micro_batch_tokens`)
        self._flops: tuple[int, float] | None = None  # decoder parameters and the device's peak (`_utilisation`)

    async def on_stop(self) -> None:
        try:
            await super().on_stop()
        finally:
            self.heldout.close()

    def _load_policy(self, path: str):
        from asyncrl.rl.model.policy import load_policy

        model, tokenizer, fmt = load_policy(path, self.device, torch.float32)
        if self.config.attn_implementation:
            model.set_attn_implementation(self.config.attn_implementation)
        if compiled(self.config, self.device):
            compile_layers(model)
        return model, tokenizer, fmt

    def _policy(self, checkpoint_dir: str | None = None):
        """The model to train, in train mode: the checkpoint's (or the start's) whole, or with LoRA
        the start's frozen base with fresh adapters (or the checkpoint's, which hold no base)."""
        lora = self.config.lora
        if not lora.rank:
            model, tokenizer, fmt = self._load_policy(checkpoint_dir or self.model_path)
            self._merged = None
            return self._checkpointed(model).train(), tokenizer, fmt
        from asyncrl.rl.trainer.lora import MergedWeights, lora_policy

        base, tokenizer, fmt = self._load_policy(self.model_path)
        model = lora_policy(self._checkpointed(base), lora, self.device, checkpoint_dir)
        self._merged = MergedWeights(model) if lora.sync == "merged" else None
        return model.train(), tokenizer, fmt

    def _checkpointed(self, model):
        """``--trainer.activation_checkpointing``: each decoder layer recomputes its activations in
        the backward (transformers' non-reentrant checkpointing, which needs no input that requires
        grad, so a frozen LoRA base works too); FSDP2 shards the layers with it on. transformers
        5.23 renamed ``gradient_checkpointing_enable`` (deprecated since) to
        ``activation_checkpointing_enable``: the new name where the model has it."""
        if self.config.activation_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:  # transformers 5.0 to 5.22
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    def _shard_policy(self) -> None:
        """Shard the policy (and the KL reference) over the rank group just formed and rebuild the
        optimiser over the shards (`rank_join`)."""
        from asyncrl.rl.trainer.fsdp import shard_model

        shard_model(self.model, self.device, bf16=self.config.bf16)
        if self.ref is not None:
            shard_model(self.ref, self.device, bf16=self.config.bf16)
        if self._merged is not None:  # its buffers were made like the unsharded weights
            from asyncrl.rl.trainer.lora import MergedWeights

            self._merged = MergedWeights(self.model)
        self.optimizer = self._new_optimizer()

    async def _run(self, what: str, deadline_s: float, fn, *args):
        """``fn(*args)`` off the event loop; on a rank group, one guarded call of every rank."""
        return await self.parallel.run(what, deadline_s or DEADLINE_S, fn, *args)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        # fused: one kernel for every parameter's update on a GPU (torch's own); elsewhere its default
        return torch.optim.AdamW(
            trainable,
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
            fused=self.device.type == "cuda" or None,
        )

    @endpoint
    async def train_step(self, groups: list[RolloutGroup], deadline_s: float = 0.0) -> dict[str, float]:
        """One optimiser step on ``groups``; returns the step's metrics. With a rank group every
        rank gets the whole batch and trains on its share; ``deadline_s`` bounds the step there."""
        for g in groups:
            validate_group(g)
        return await self._run(f"train step {self.steps + 1}", deadline_s, self._train_step, groups)

    def _train_step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One optimiser step of this process on its share of ``groups`` (all of them at world
        size 1; ``trainer/split.py``): every loss divided by the whole batch's count, gradients
        summed across ranks; the metrics of the whole batch."""
        start = time.perf_counter()
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        advantages = step_advantages(groups, cfg.loss, cfg.normalize_std)
        n_tokens, n_seqs = (float(n) for n in batch_counts(groups))
        normalizer = loss_normalizer(cfg.loss, n_tokens, n_seqs)
        share, share_advantages = self.parallel.share(groups, advantages)
        budget = self.micro_batch_tokens()
        if not share:
            batches = []
        elif cfg.pack_tokens:
            batches = packed_micro_batches(share, share_advantages, budget, self.device, cfg.pack_tokens)
        else:
            batches = micro_batches(share, share_advantages, budget, self.device)
        batches = self.parallel.align(batches, self.model, self.steps + 1)
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._accumulate_all(batches, normalizer, n_tokens)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self.parallel.clip_grad_norm(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        lr = learning_rate(cfg, self.steps)
        set_learning_rate(self.optimizer, lr)
        try:
            self.optimizer.step()
        except torch.OutOfMemoryError as exc:  # AdamW's two moments are made at the first step
            self.optimizer.zero_grad(set_to_none=True)
            raise self._does_not_fit(
                "the optimiser's state (AdamW: two fp32 copies of the trained weights)", exc
            ) from None
        self.steps += 1
        sums.pop("tokens", None)
        sums.pop("ratio_max", None)
        sums = self.parallel.sum_metrics(sums)
        sums.update(
            grad_norm=float(grad_norm),
            lr=lr,
            tokens=n_tokens,
            sequences=n_seqs,
            micro_batches=len(batches),
            micro_batch_tokens=budget,
            train_s=time.perf_counter() - start,
        )
        sums.update(self._utilisation(groups, sums["train_s"]))  # this rank's memory, the group's MFU
        return sums

    @endpoint
    async def gradients(self, deadline_s: float = 0.0) -> dict[str, torch.Tensor]:
        """The last step's gradients, whole (on a rank group every rank gathers; rank 0 returns
        them, the others an empty dict). For tests and debugging: it holds the whole gradient in
        this process."""

        def gather() -> dict[str, torch.Tensor]:
            grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
            return {name: g.detach().cpu() for name, g in self.parallel.gathered(grads).items()}

        return await self._run("gathering the gradients", deadline_s, gather)

    def _utilisation(self, groups: list[RolloutGroup], seconds: float) -> dict[str, float]:
        """The step's model FLOPs utilisation and peak device memory (``trainer/flops.py``), on a
        GPU whose peak is known; nothing elsewhere."""
        from asyncrl.rl.trainer.flops import decoder_parameters, peak_flops, step_flops

        if self.device.type != "cuda":
            return {}
        if self._flops is None:
            self._flops = (decoder_parameters(self.model), peak_flops(self.device))
        body, peak = self._flops
        out = {"peak_mem_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}
        if peak:
            flops = step_flops(self.model.config, body, groups, weights_train=not self.config.lora.rank)
            out["mfu"] = flops / max(seconds, 1e-9) / peak / self.parallel.world_size
        return out

    def micro_batch_tokens(self) -> int:
        """``--trainer.micro_batch_tokens``, or auto's choice (``trainer/memory_budget.py``), made
        at the first step that needs it: the policy is on its device then, a colocated vLLM
        engine has taken its share, and the optimiser state yet to come is counted."""
        if self.config.micro_batch_tokens:
            return self.config.micro_batch_tokens
        if not self._auto_tokens:
            from asyncrl.rl.trainer.memory_budget import resolve_micro_batch_tokens

            cfg = self.config
            self._auto_tokens, free = resolve_micro_batch_tokens(
                0,
                self.model,
                self.optimizer,
                self.device,
                checkpointing=cfg.activation_checkpointing,
                full_logits=bool(self._fallback_reason()),
                pack_tokens=cfg.pack_tokens,
            )
            if self.device.type == "cuda" and not free:  # the gradients and AdamW's state alone overflow it
                raise self._does_not_fit("the policy with its gradients and AdamW's state")
            where = f"{free / 2**30:.1f} GiB free" if free else f"{self.device.type}: the fixed default"
            print(f"trainer: micro_batch_tokens auto -> {self._auto_tokens} ({where})", flush=True)
        return self._auto_tokens

    def _fallback_reason(self) -> str:
        """Why this trainer scores through full logits ("" when it does not: ``scoring/logprobs.py``)."""
        # the strategy, not the config: a rank joins a group whatever its config's world_size says
        return self.parallel.head_fallback(self.model)

    def _accumulate_all(self, batches: list[MicroBatch], normalizer: float, n_tokens: float) -> dict[str, float]:
        """Gradients of every micro-batch into the parameters; the step's metrics: loss terms
        summed (each is already a share of the whole batch's), the others weighted by tokens."""
        sums: dict[str, float] = {}
        for batch in batches:
            try:
                metrics = self._accumulate(batch, normalizer)
            except torch.OutOfMemoryError as exc:
                raise micro_batch_error(
                    exc,
                    step=self.steps + 1,
                    shape=tuple(batch.input_ids.shape),
                    optimizer=self.optimizer,
                    device=self.device,
                    micro_batch_tokens=self.config.micro_batch_tokens,
                    auto_tokens=self._auto_tokens,
                ) from None
            weight = float(batch.mask.sum()) / max(n_tokens, 1.0)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (float(v) if k in ("loss", "pg_loss") else float(v) * weight)
        return sums

    def _does_not_fit(self, what: str, exc: torch.OutOfMemoryError | None = None) -> TrainerMemoryError:
        return does_not_fit(what, self.model_path, self.device, exc)

    def _accumulate(self, batch: MicroBatch, normalizer: float) -> dict[str, torch.Tensor]:
        """One micro-batch's loss, its gradient added to the parameters; its metrics. Log-probs by
        the fused head where it applies, else through full logits (``scoring/logprobs.py``)."""
        cfg = self.config
        score = dict(
            fused=not self._fallback_reason(),
            autocast_dtype=(torch.bfloat16 if self.device.type == "cuda" and cfg.bf16 else None),
        )
        # the entropy: of the policy where it is scored (a metric)
        new, entropy, student_topk = scored_logprobs_at(
            self.model, batch, self.temperature, batch.teacher_ids, entropy=True, **score
        )
        ref = None
        if cfg.loss.kl_coef > 0:
            with torch.no_grad(), self._reference() as reference:
                ref, _ = scored_logprobs(reference, batch, self.temperature, **score)
        loss, metrics = grpo_loss(
            new,
            batch.behaviour,
            batch.advantages,
            batch.mask,
            cfg.loss,
            ref_logprobs=ref,
            entropy=entropy,
            normalizer=normalizer,
            teacher_logprobs=batch.teacher,
            student_topk=student_topk,
            teacher_topk=batch.teacher_topk if student_topk is not None else None,
        )
        loss.backward()
        return metrics

    @contextlib.contextmanager
    def _reference(self):
        """The KL reference to score with: the loaded copy, or with LoRA the policy itself with its
        adapters disabled for the duration (peft's ``disable_adapter``: the frozen base)."""
        if self.ref is not None:
            yield self.ref
        else:
            with self.model.disable_adapter():
                yield self.model

    @endpoint
    async def evaluate(
        self, samples: int = 4, max_new_tokens: int = 0, batch_size: int = 64, deadline_s: float = 0.0
    ) -> dict[str, float | dict[str, int]]:
        """Solve rate on the task's held-out split (``data.n_heldout`` problems): ``greedy``, and
        ``sampled`` at the training temperature (``samples`` completions per problem; 0 skips it);
        the task's metrics of the greedy episodes as ``task/<name>`` (means over the problems);
        failed score/step calls of both as ``task_errors/<kind>`` (counts; absent when none); an
        agent's failed episodes by what they were as ``failures`` (`heldout_answer`).
        The task's calls run under the samplers' deadline and failure budget
        (``--task.score_timeout_s``, ``--task.max_failure_rate``, counted over every evaluation of
        the run): past the budget a `TaskFailureError` naming the first failure ends the call.
        With a rank group every rank evaluates the same problems in step (a sharded forward
        gathers from every rank), sampling from the same seed."""
        from asyncrl.rl.model.tally import heldout_answer

        parts = await self.evaluate_heldout(None, None, samples, max_new_tokens, batch_size, deadline_s)
        return heldout_answer(parts, samples)

    @endpoint
    async def evaluate_heldout(
        self,
        greedy: list[int] | None = None,
        sampled: list[int] | None = None,
        samples: int = 4,
        max_new_tokens: int = 0,
        batch_size: int = 64,
        deadline_s: float = 0.0,
    ) -> list[HeldoutPart]:
        """`evaluate`'s episodes as they add up, in parts (`HeldoutPart`: sums, tagged with the
        version this trainer holds): the held-out problems ``greedy`` greedily, ``sampled`` with
        ``samples`` completions each (indices into the split; None: all of them, and none sampled
        with ``samples`` 0). The driver's: it adds them to what samplers solved
        (``rl/driver/heldout.py``). How far it has got: `heldout_progress`."""
        limit = max_new_tokens or self.fmt.max_new_tokens_hint
        options = dict(
            samples=samples,
            max_new_tokens=limit,
            batch_size=batch_size,
            temperature=self.temperature,
            compiled=compiled(self.config, self.device),
            greedy=greedy,
            sampled=sampled,
            version=self.steps,
        )

        def run() -> list[HeldoutPart]:
            return self.heldout(self.model, self.tokenizer, self.fmt, **options)

        return await self._run(
            "the held-out evaluation", deadline_s, self.parallel.in_step, run, self.seed * 1_000_003 + self.steps
        )

    @endpoint
    async def heldout_progress(self) -> list[int]:
        """Problems the evaluation under way (or the last) has solved so far: greedy, sampled.
        Answered from memory while the evaluation runs on its thread."""
        return list(self.heldout.progress)
