"""The trainer actor: recomputes log-probs, takes GRPO steps, and sends its weights to the samplers.

One trainer may be N processes (``--trainer.world_size``): each call below is written once, and
what differs between one process and a rank of N (the batch's share, the guard, gathers, the
checkpoint's format) is the trainer's strategy, ``self.ranks.parallel`` (``trainer/parallel.py``).
A batch arrives as `RolloutGroup`s; each completion becomes one sequence ``prompt + completion``
whose completion tokens are scored. Micro-batches are cut by a token budget, padded tokens
counted (``trainer/batching.py``; several sequences per row with ``pack_tokens``,
``trainer/packing.py``), and the loss (``trainer/loss.py``) is normalised by the whole batch's
count, so the accumulated gradient equals that of the full batch whatever the cut. The held-out
evaluation is ``trainer/heldout.py``'s, and an out-of-memory error is worded by
``trainer/out_of_memory.py``.

The actor holds its parts and forwards their endpoints in one line each: the policy, optimiser
and step count (``policy``, `TrainedPolicy`), its place in a rank group (``ranks``, `RankMember`),
its side of the weight sync as rank 0 of the weight-sync group (``weights``, `WeightSending`, whose
seat the ``sync_*`` endpoints of `SyncEndpoints` reach) and its checkpoints and saved policy
(``checkpoints``, `Checkpointing`). It is built for ``config.world_size``: whole, its optimiser with
it, at 1; a rank of N takes its strategy, its shards and its optimiser at `rank_join`.
"""

from __future__ import annotations

import time

import torch

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.member import SyncEndpoints, SyncSide
from asyncrl.comm.weights import SyncStats
from asyncrl.rl.actor_device import actor_device
from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.config.trainer import TrainerConfig
from asyncrl.rl.model.tally import HeldoutAsk, HeldoutPart
from asyncrl.rl.rollout import RolloutGroup, validate_group
from asyncrl.rl.scoring.batch import MicroBatch
from asyncrl.rl.scoring.logprobs import scored_logprobs, scored_logprobs_at
from asyncrl.rl.tasks.loading import TaskSpec
from asyncrl.rl.trainer.batching import micro_batches
from asyncrl.rl.trainer.checkpointing import Checkpointing
from asyncrl.rl.trainer.compile import compiled
from asyncrl.rl.trainer.corrections import SUM_COLUMNS, empty_tally, merge, tally_metrics
from asyncrl.rl.trainer.heldout import HeldoutEvaluation
from asyncrl.rl.trainer.loss import grpo_loss, loss_normalizer, step_advantages
from asyncrl.rl.trainer.memory_budget import AutoBudget, resolve_micro_batch_tokens
from asyncrl.rl.trainer.metrics import TrainStepMetrics
from asyncrl.rl.trainer.out_of_memory import TrainerMemoryError, does_not_fit, micro_batch_error
from asyncrl.rl.trainer.packing import packed_micro_batches
from asyncrl.rl.trainer.policy import TrainedPolicy, checkpoint_layers
from asyncrl.rl.trainer.rank_member import RankMember
from asyncrl.rl.trainer.schedule import learning_rate, set_learning_rate
from asyncrl.rl.trainer.split import batch_counts
from asyncrl.rl.trainer.weight_sending import WeightSending
from asyncrl.runtime.actor import endpoint


class TrainerActor(SyncEndpoints):
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
        self.model_path = model_path
        try:
            self.policy = TrainedPolicy(model_path, config, self.device)
        except torch.OutOfMemoryError as exc:
            raise self._does_not_fit(
                "the policy" + (" and its KL reference" if config.loss.kl_coef else ""), exc
            ) from None
        self.ranks = RankMember(self.device, config.world_size, self.policy.shard)
        self.weights = WeightSending(self.ranks, self.policy.weight_tensors)
        self.checkpoints = Checkpointing(self.ranks, self.policy, loaded=self.weights.forget)
        self._budget = AutoBudget(
            self._resolve_budget,
            checkpointing=bool(config.activation_checkpointing),
            may_turn_on=config.activation_checkpointing is None
            and self.device.type == "cuda"
            and self.ranks.parallel.world_size == 1,
        )  # --trainer.micro_batch_tokens 0 (`micro_batch_tokens`)
        self._flops: tuple[int, float] | None = None  # decoder parameters and the device's peak (`_utilisation`)

    async def on_stop(self) -> None:
        try:
            await self.weights.seat.leave()
            await self.ranks.close()
        finally:
            self.heldout.close()

    @property
    def sync_side(self) -> SyncSide:
        return self.weights.seat

    # The policy's, read here often enough (and by tests) to be named on the actor.
    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.policy.optimizer

    @property
    def steps(self) -> int:
        return self.policy.steps

    # --- the parts' endpoints (each documented on the method it forwards to) ---------------------

    @endpoint
    async def rank_listen(self, host: str, port: int = 0) -> int:
        return self.ranks.listen(host, port)

    @endpoint
    async def rank_join(self, address: SyncAddress, rank: int) -> str:
        return await self.ranks.join(address, rank)

    @endpoint
    async def abort_call(self, failed_rank: int, reason: str) -> None:
        self.ranks.abort_call(failed_rank, reason)

    @endpoint
    async def setup_sender(
        self, timeout_s: float = 60.0, bucket_bytes: int = 0, wire_dtype: str = "", delta: bool = False
    ) -> int:
        return await self.weights.setup(timeout_s, bucket_bytes, wire_dtype, delta)

    @endpoint
    async def send_weights(self, version: int) -> SyncStats:
        return await self.weights.send(version)

    @endpoint
    async def weights_digest(self, deadline_s: float = 0.0) -> str:
        return await self.weights.digest(deadline_s)

    @endpoint
    async def save_checkpoint(
        self, run_dir: str, step: int, keep: int, run_state: bytes, deadline_s: float = 0.0
    ) -> str:
        return await self.checkpoints.write(run_dir, step, keep, run_state, deadline_s)

    @endpoint
    async def load_checkpoint(self, path: str, deadline_s: float = 0.0) -> int:
        return await self.checkpoints.load(path, deadline_s)

    @endpoint
    async def save(self, path: str, extra_files: dict[str, str] | None = None, deadline_s: float = 0.0) -> str:
        return await self.checkpoints.save(path, extra_files, deadline_s)

    # --- what the trainer itself does ------------------------------------------------------------

    @endpoint
    async def check_fits(self, longest: int) -> None:
        """Stop the run before its first step, in one line, where a sequence of ``longest`` tokens
        could not fit a micro-batch even with activation checkpointing (where auto may turn it on).
        The driver asks once the samplers run (a colocated engine has taken its share, so memory is
        as at the first step), with the completion limit. Chooses nothing: the first step does."""
        if self.config.micro_batch_tokens or self.device.type != "cuda":
            return
        most, free = self._budget.most()
        if not free:  # as at the first step: the gradients and AdamW's state alone overflow it
            raise self._does_not_fit("the policy with its gradients and AdamW's state")
        if longest > most:
            raise self._does_not_fit(
                f"a completion of up to {longest} tokens (--sampler.max_new_tokens, --sampler.lengths) in "
                f"the {most}-token micro-batch the memory left allows"
            )

    @endpoint
    async def train_step(self, groups: list[RolloutGroup], deadline_s: float = 0.0) -> TrainStepMetrics:
        """One optimiser step on ``groups``; returns the step's metrics. With a rank group every
        rank gets the whole batch and trains on its share; ``deadline_s`` bounds the step there."""
        for g in groups:
            validate_group(g)
        return await self.ranks.run(f"train step {self.steps + 1}", deadline_s, self.train_share, groups)

    def train_share(self, groups: list[RolloutGroup]) -> TrainStepMetrics:
        """One optimiser step of this process on its share of ``groups`` (all of them at world
        size 1; ``trainer/split.py``): every loss divided by the whole batch's count, gradients
        summed across ranks; the metrics of the whole batch. What `train_step` runs on every rank;
        called directly, in the trainer's own process (benchmarks), it is one rank's step."""
        start = time.perf_counter()
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        advantages = step_advantages(groups, cfg.loss, cfg.normalize_std)
        n_tokens, n_seqs = (float(n) for n in batch_counts(groups))
        normalizer = loss_normalizer(cfg.loss, n_tokens, n_seqs)
        share, share_advantages = self.ranks.parallel.share(groups, advantages)
        budget = self.micro_batch_tokens(
            max((len(s.prompt_ids) + len(c) for s in share for c in s.completion_ids), default=0)
        )
        if not share:
            batches = []
        elif cfg.pack_tokens:
            batches = packed_micro_batches(share, share_advantages, budget, self.device, cfg.pack_tokens)
        else:
            batches = micro_batches(share, share_advantages, budget, self.device)
        batches = self.ranks.parallel.align(batches, self.model, self.steps + 1)
        self.optimizer.zero_grad(set_to_none=True)
        sums, tally = self._accumulate_all(batches, normalizer, n_tokens)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self.ranks.parallel.clip_grad_norm(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        lr = learning_rate(cfg, self.steps)
        set_learning_rate(self.optimizer, lr)
        try:
            self.optimizer.step()
        except torch.OutOfMemoryError as exc:  # AdamW's two moments are made at the first step
            self.optimizer.zero_grad(set_to_none=True)
            raise self._does_not_fit(
                "the optimiser's state (AdamW: two fp32 copies of the trained weights)", exc
            ) from None
        self.policy.steps += 1
        sums.pop("tokens", None)
        sums.pop("ratio_max", None)
        sums = self.ranks.parallel.sum_metrics(sums)
        corrections = {}
        if cfg.loss.corrected:  # every rank has the same config: all reduce their tallies, or none
            mine = tally if tally is not None else empty_tally(self.device)
            corrections = tally_metrics(self.ranks.parallel.reduce_tally(mine, SUM_COLUMNS))
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
        return TrainStepMetrics.of({**sums, **corrections})

    @endpoint
    async def gradients(self, deadline_s: float = 0.0) -> dict[str, torch.Tensor]:
        """The last step's gradients, whole (on a rank group every rank gathers; rank 0 returns
        them, the others an empty dict). For tests and debugging: it holds the whole gradient in
        this process."""

        def gather() -> dict[str, torch.Tensor]:
            grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
            return {name: g.detach().cpu() for name, g in self.ranks.parallel.gathered(grads).items()}

        return await self.ranks.run("gathering the gradients", deadline_s, gather)

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
            out["mfu"] = flops / max(seconds, 1e-9) / peak / self.ranks.parallel.world_size
        return out

    def micro_batch_tokens(self, longest: int = 0) -> int:
        """``--trainer.micro_batch_tokens``, or auto's choice (`AutoBudget`). ``longest``: the
        step's longest sequence, prompt included; where it is longer than auto's budget without
        activation checkpointing (and that is auto), checkpointing goes on, at whichever step it
        first comes, and where it is longer than the budget even so, the run stops here in one line
        rather than run out of memory in the middle of the step."""
        if self.config.micro_batch_tokens:
            return self.config.micro_batch_tokens
        budget, first = self._budget, not self._budget.tokens
        if budget.fit(longest):
            checkpoint_layers(self.model)
        for line in budget.said:
            print(f"trainer: {line}", flush=True)
        if first and self.device.type == "cuda" and not budget.free:  # gradients and AdamW's state alone overflow it
            raise self._does_not_fit("the policy with its gradients and AdamW's state")
        if longest > budget.tokens and self.device.type == "cuda":
            raise self._does_not_fit(
                f"a sequence of {longest} tokens (prompt and completion) in the {budget.tokens}-token "
                "micro-batch the memory left allows"
            )
        return budget.tokens

    def _resolve_budget(self, checkpointing: bool) -> tuple[int, int]:
        return resolve_micro_batch_tokens(
            0,
            self.model,
            self.optimizer,
            self.device,
            checkpointing=checkpointing,
            full_logits=bool(self.fallback_reason()),
            pack_tokens=self.config.pack_tokens,
        )

    def fallback_reason(self) -> str:
        """Why this trainer scores through full logits ("" when it does not: ``scoring/logprobs.py``)."""
        return self.ranks.parallel.head_fallback(self.model)

    def _accumulate_all(
        self, batches: list[MicroBatch], normalizer: float, n_tokens: float
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """Gradients of every micro-batch into the parameters; the step's metrics: loss terms
        summed (each is already a share of the whole batch's), the others weighted by tokens; and
        with an off-policy correction, the micro-batches' tallies as one (`corrections.merge`)."""
        sums: dict[str, float] = {}
        tally = None
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
                    auto_tokens=self._budget.tokens,
                ) from None
            if "correction" in metrics:
                tally = merge(tally, metrics.pop("correction"))
            weight = float(batch.mask.sum()) / max(n_tokens, 1.0)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (float(v) if k in ("loss", "pg_loss") else float(v) * weight)
        return sums, tally

    def _does_not_fit(self, what: str, exc: torch.OutOfMemoryError | None = None) -> TrainerMemoryError:
        return does_not_fit(what, self.model_path, self.device, exc)

    def _accumulate(self, batch: MicroBatch, normalizer: float) -> dict[str, torch.Tensor]:
        """One micro-batch's loss, its gradient added to the parameters; its metrics. Log-probs by
        the fused head where it applies, else through full logits (``scoring/logprobs.py``)."""
        cfg = self.config
        fused = not self.fallback_reason()
        autocast = torch.bfloat16 if self.device.type == "cuda" and cfg.bf16 else None
        # the entropy: of the policy where it is scored (a metric)
        new, entropy, student_topk = scored_logprobs_at(
            self.model, batch, self.temperature, batch.teacher_ids, entropy=True, fused=fused, autocast_dtype=autocast
        )
        ref = None
        if cfg.loss.kl_coef > 0:
            with torch.no_grad(), self.policy.reference() as reference:
                ref, _ = scored_logprobs(reference, batch, self.temperature, fused=fused, autocast_dtype=autocast)
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
            # the weights this forward runs with are version self.steps (one step a batch)
            token_lag=None if batch.versions is None else self.steps - batch.versions,
            with_tally=True,
        )
        loss.backward()
        return metrics

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

        ask = HeldoutAsk(samples=samples, max_new_tokens=max_new_tokens, rows=batch_size)
        return heldout_answer(await self.evaluate_heldout(ask, deadline_s), samples)

    @endpoint
    async def evaluate_heldout(self, ask: HeldoutAsk, deadline_s: float = 0.0) -> list[HeldoutPart]:
        """`evaluate`'s episodes as they add up, in parts (`HeldoutPart`: sums, tagged with the
        version this trainer holds): the held-out problems ``ask`` names (`HeldoutAsk`). The
        driver's: it adds them to what samplers solved (``rl/driver/heldout.py``). How far it has
        got: `heldout_progress`."""
        fast, version = compiled(self.config, self.device), self.steps

        def run() -> list[HeldoutPart]:
            return self.heldout(
                self.model,
                self.policy.tokenizer,
                self.policy.fmt,
                ask,
                temperature=self.temperature,
                compiled=fast,
                version=version,
            )

        return await self.ranks.run(
            "the held-out evaluation", deadline_s, self.ranks.parallel.in_step, run, self.seed * 1_000_003 + self.steps
        )

    @endpoint
    async def heldout_progress(self) -> list[int]:
        """Problems the evaluation under way (or the last) has solved so far: greedy, sampled.
        Answered from memory while the evaluation runs on its thread."""
        return list(self.heldout.progress)
