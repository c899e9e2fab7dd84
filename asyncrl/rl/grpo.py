"""The fully-async GRPO loop on Countdown: samplers stream groups, the trainer steps, weights sync.

    driver (this module)            trainer actor (rank 0)        sampler actors (ranks 1..)
    pump per sampler  <------------------------------------------ rollouts() stream
      -> RolloutQueue (bounded, staleness filter)
    step: get_batch -> train_step --------------> GRPO step
          send/receive weights  ----------------> WeightSender ===> WeightReceiver (between decoding steps)

In ``async`` mode the samplers never stop: while the trainer takes step k they generate for step
k+1 with weights at most ``max_staleness`` versions old, and the queue drops (and counts) older
groups. New weights go into a sampler between two decoding steps (``sampler.weight_update``), so
a sync never waits for a batch to finish; a group is tagged with the version it began under. In ``sync`` mode each step's groups are generated after the previous sync and nothing is
generated during training: the synchronous baseline, same code, staleness always 0.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.comm.member import form_group
from asyncrl.rl.config import config_to_dict
from asyncrl.rl.countdown import CORRECT_REWARD, CountdownConfig, train_and_heldout
from asyncrl.rl.rollout import RolloutGroup, RolloutQueue
from asyncrl.rl.trainer import TrainerConfig


@dataclass(frozen=True)
class RunSection:
    steps: int = 500
    """Optimiser steps to take."""
    groups_per_step: int = 16
    """Prompts (groups of ``sampler.group_size`` completions) in one training batch."""
    mode: str = "async"
    """'async': samplers generate continuously; 'sync': generate, then train, then sync (baseline)."""
    max_staleness: int = 1
    """Async mode: train on groups at most this many weight versions old; older ones are dropped."""
    queue_capacity: int = 0
    """Rollout queue bound in groups (0: two batches). Samplers wait when it is full."""
    sync_every: int = 1
    """Send the weights to the samplers after every this many steps."""
    eval_every: int = 100
    """Held-out solve rates every this many steps (and before the first and after the last)."""
    eval_samples: int = 4
    """Sampled completions per held-out problem for the sampled solve rate (0: greedy only)."""
    n_train: int = 50000
    """Problems in the train split (a run of the default length sees most of them once, so the
    train solve rate is measured on problems new to the policy)."""
    n_heldout: int = 500
    """Problems in the held-out split (never trained on; at most the warm start's heldout_reserve)."""
    seed: int = 0
    """Seed of the samplers and the trainer (runs that differ only in it share the problems)."""
    data_seed: int = 0
    """Seed of the train and held-out splits. With the embedded model it must be the warm start's
    ``data_seed``: that is the split whose held-out problems the warm start never saw."""
    run_dir: str = ""
    """Where config.json, metrics.jsonl and checkpoints go (default: runs/grpo-<time>)."""
    save_every: int = 0
    """Also save a checkpoint every this many steps (0: only the final one)."""
    device: str = "auto"
    """'auto' (one GPU each for trainer and samplers when there are enough, else CPU), 'cpu' or 'cuda'."""
    step_timeout_s: float = 900.0
    """Deadline of each phase of a step (waiting for a batch, the train step, the weight sync)."""

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', not {self.mode!r}")
        if self.eval_samples < 0:
            raise ValueError(f"eval_samples must be >= 0, not {self.eval_samples!r}")
        for name in ("steps", "groups_per_step", "sync_every", "eval_every", "n_train", "n_heldout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)!r}")
        if self.max_staleness < 0 or self.queue_capacity < 0 or self.save_every < 0:
            raise ValueError("max_staleness, queue_capacity and save_every must be >= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")


@dataclass(frozen=True)
class SamplerSection:
    count: int = 1
    """Number of sampler actors."""
    group_size: int = 8
    """Completions per prompt."""
    prompts_per_batch: int = 8
    """Prompts a sampler generates for at once."""
    max_new_tokens: int = 0
    """Completion length limit (0: what the model suggests)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores with the same one)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    weight_update: str = "in_flight"
    """How new weights enter a sampler: 'in_flight' (between two decoding steps of the batch being
    generated, which finishes on them) or 'pause' (after that batch finishes)."""

    def __post_init__(self) -> None:
        if self.weight_update not in ("in_flight", "pause"):
            raise ValueError(f"weight_update must be 'in_flight' or 'pause', not {self.weight_update!r}")
        if self.count < 1 or self.group_size < 2 or self.prompts_per_batch < 1:
            raise ValueError("need count >= 1, group_size >= 2 (GRPO compares within a group), prompts_per_batch >= 1")


def _default_model_section():
    from asyncrl.rl.model import ModelConfig

    return ModelConfig()


def _default_warm_start():
    from asyncrl.rl.model import WarmStartConfig

    return WarmStartConfig()


@dataclass(frozen=True)
class GRPOConfig:
    run: RunSection = field(default_factory=RunSection)
    model_path: str = ""
    """A local Hugging Face checkpoint directory; empty: the embedded default model."""
    model: Any = field(default_factory=_default_model_section)
    """Shape of the embedded default model."""
    warm_start: Any = field(default_factory=_default_warm_start)
    """Supervised warm start of the embedded default model (cached on disk)."""
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class Metrics:
    """metrics.jsonl in the run directory, and what the progress line shows."""

    def __init__(self, run_dir: str, steps: int):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1)
        self.steps = steps
        self.tty = sys.stdout.isatty()
        self.start = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        heldout = record.get("heldout_solve_rate")
        line = (f"step {record['step']:>4}/{self.steps}  reward {record['reward_mean']:.3f}  "
                f"solve {record['train_solve_rate']:.2f}  stale {record['staleness_mean']:.2f}  "
                f"samples/s {record['samples_per_s']:.1f}  tok/s {record['tokens_per_s']:.0f}  "
                + (f"held-out {heldout:.2f} greedy {record.get('heldout_sampled_solve_rate', float('nan')):.2f} "
                   "sampled  " if heldout is not None else "")
                + f"{time.monotonic() - self.start:.0f}s")
        if self.tty:
            print("\r" + line, end="\n" if heldout is not None else "", flush=True)  # evals stay visible
        elif heldout is not None or record["step"] % max(1, self.steps // 50) == 0:  # a log, not a bar
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print()
        self.file.close()


async def train(config: GRPOConfig, sup, *, log=print) -> dict[str, Any]:
    """Run GRPO with ``config`` on the actors of ``sup``; returns the summary (also in the run dir)."""
    from asyncrl.rl.model import default_model
    from asyncrl.rl.sampler import SamplerActor, SamplingParams
    from asyncrl.rl.trainer import TrainerActor
    from asyncrl.runtime.devices import detect

    run = config.run
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars would bury the progress line
    run_dir = os.path.abspath(run.run_dir or os.path.join("runs", time.strftime("grpo-%Y%m%d-%H%M%S")))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config_to_dict(config), f, indent=2, default=str)
    if not config.model_path:
        _check_heldout_unseen(config)
    model_path = config.model_path or await asyncio.to_thread(
        default_model, config.model, config.warm_start, config.countdown, log=log)
    kind, ids = detect("auto")
    cuda = run.device == "cuda" or (run.device == "auto" and kind == "cuda" and len(ids) >= 1 + config.sampler.count)
    device, gpus = ("cuda", 1) if cuda else ("cpu", 0)
    train_split, heldout = train_and_heldout(run.data_seed, run.n_train, run.n_heldout, config.countdown)
    log(f"run dir {run_dir}; model {model_path}; {device}; {config.sampler.count} sampler(s); mode {run.mode}")

    trainer_fields = config_to_dict(config.trainer) | {"temperature": config.sampler.temperature}
    # On CPU, one thread per actor: torch's default (a thread per core in every process) makes the
    # actors of one host fight over the same cores, and throughput collapses.
    env = {"TQDM_DISABLE": "1"} | ({} if cuda else {"OMP_NUM_THREADS": "1"})
    trainer = await sup.spawn(TrainerActor, model_path, trainer_fields, name="trainer", gpus=gpus, env=env,
                              kwargs={"device": device, "seed": run.seed})
    sampling = SamplingParams(max_new_tokens=config.sampler.max_new_tokens or _completion_limit(model_path),
                              temperature=config.sampler.temperature, top_p=config.sampler.top_p)
    samplers = [await sup.spawn(SamplerActor, model_path, name=f"sampler{i}", gpus=gpus, env=env, kwargs={
                    "device": device, "seed": run.seed * 1000 + i, "countdown": config_to_dict(config.countdown),
                    "n_train_problems": run.n_train, "n_heldout_problems": run.n_heldout, "split_seed": run.data_seed,
                    "group_size": config.sampler.group_size, "prompts_per_batch": config.sampler.prompts_per_batch,
                    "sampling": sampling,
                    "sync_timeout_s": run.step_timeout_s, "weight_update": config.sampler.weight_update})
                for i in range(config.sampler.count)]
    host = os.environ.get("ASYNCRL_NODE_ADDR", "127.0.0.1")
    await form_group([trainer, *samplers], host, timeout_s=120, backend="nccl" if cuda else "gloo")
    await asyncio.gather(trainer.setup_sender(run.step_timeout_s),
                         *(s.setup_receiver(run.step_timeout_s) for s in samplers))
    loop = _Loop(config, trainer, samplers, heldout, run_dir, log)
    return await loop.execute()


class _Loop:
    def __init__(self, config: GRPOConfig, trainer, samplers, heldout, run_dir: str, log):
        self.config, self.run = config, config.run
        self.trainer, self.samplers, self.heldout = trainer, samplers, heldout
        self.run_dir, self.log = run_dir, log
        capacity = self.run.queue_capacity or 2 * self.run.groups_per_step
        staleness = self.run.max_staleness if self.run.mode == "async" else 0
        self.queue = RolloutQueue(capacity, staleness)
        self.version = 0
        self.samples = 0
        self.tokens = 0  # completion tokens trained on

    async def evaluate(self) -> dict[str, float]:
        return await self.trainer.with_timeout(self.run.step_timeout_s).evaluate(self.heldout, self.run.eval_samples)

    async def pump(self, sampler, max_groups: int = 0) -> None:
        """Feed one sampler's stream into the queue (its put waits when the queue is full)."""
        async for group in sampler.rollouts(max_groups):
            await self.queue.put(group, timeout_s=self.run.step_timeout_s)

    async def execute(self) -> dict[str, Any]:
        run = self.run
        metrics = Metrics(self.run_dir, run.steps)
        initial = await self.evaluate()
        self.log("held-out solve rate before GRPO: " + _rates(initial))
        pumps = [asyncio.ensure_future(self.pump(s)) for s in self.samplers] if run.mode == "async" else []
        start = time.monotonic()
        heldout = initial
        try:
            for step in range(1, run.steps + 1):
                record = await self.step(step, start)
                if step % run.eval_every == 0 or step == run.steps:
                    heldout = await self.evaluate()
                    record["heldout_solve_rate"] = heldout["greedy"]
                    if "sampled" in heldout:
                        record["heldout_sampled_solve_rate"] = heldout["sampled"]
                if run.save_every and step % run.save_every == 0:
                    await self.trainer.save(os.path.join(self.run_dir, f"checkpoint-{step}"))
                metrics.write(record)
                for pump in pumps:
                    if pump.done():
                        pump.result()  # a sampler's failure surfaces here, with its cause
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self.queue.close()
            metrics.close()
        final_dir = await self.trainer.save(os.path.join(self.run_dir, "final"))
        summary = {"steps": run.steps, "mode": run.mode, "heldout_before": initial, "heldout_after": heldout,
                   "wall_s": time.monotonic() - start, "samples": self.samples,
                   "samples_per_s": self.samples / max(time.monotonic() - start, 1e-9),
                   "tokens_per_s": self.tokens / max(time.monotonic() - start, 1e-9),
                   "dropped_stale": self.queue.stats().dropped_stale, "checkpoint": final_dir}
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.log(_summary_table(summary))
        return summary

    async def step(self, step: int, start: float) -> dict[str, Any]:
        run, n = self.run, self.run.groups_per_step
        t0 = time.monotonic()
        if run.mode == "sync":  # generate exactly this step's groups, with the current weights
            per = math.ceil(n / len(self.samplers))
            await asyncio.gather(*(self.pump(s, per) for s in self.samplers))
        batch: list[RolloutGroup] = await self.queue.get_batch(n, current_version=self.version,
                                                               timeout_s=run.step_timeout_s)
        t1 = time.monotonic()
        train = await self.trainer.with_timeout(run.step_timeout_s).train_step(batch)
        t2 = time.monotonic()
        self.version += 1
        sync_s = 0.0
        if self.version % run.sync_every == 0:
            await asyncio.gather(self.trainer.with_timeout(run.step_timeout_s).send_weights(self.version),
                                 *(s.with_timeout(run.step_timeout_s).receive_weights(self.version)
                                   for s in self.samplers))
            sync_s = time.monotonic() - t2
        rewards = [r for g in batch for r in g.rewards]
        staleness = [self.version - 1 - g.version for g in batch]
        self.samples += len(rewards)
        tokens = sum(len(c) for g in batch for c in g.completion_ids)
        self.tokens += tokens
        stats = self.queue.stats()
        return {"step": step, "version": self.version, "reward_mean": sum(rewards) / len(rewards),
                "train_solve_rate": sum(r >= CORRECT_REWARD for r in rewards) / len(rewards),
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_hist": {str(s): staleness.count(s) for s in sorted(set(staleness))},
                "dropped_stale": stats.dropped_stale, "queue_depth": len(self.queue),
                "completion_tokens": tokens,
                "samples_per_s": self.samples / max(time.monotonic() - start, 1e-9),
                "tokens_per_s": self.tokens / max(time.monotonic() - start, 1e-9),
                "time_s": time.monotonic() - start,
                "wait_s": t1 - t0, "train_s": t2 - t1, "sync_s": sync_s,
                "generate_s": sum(g.generate_s for g in batch) / len(batch),
                **{k: v for k, v in train.items() if k not in ("train_s",)}}


def _check_heldout_unseen(config: GRPOConfig) -> None:
    """The embedded model is warm-started on one train split; refuse a held-out set it may have seen."""
    from asyncrl.rl.config import ConfigError

    warm, run = config.warm_start, config.run
    if str(run.data_seed) != str(warm.data_seed):
        raise ConfigError(f"--run.data_seed {run.data_seed} differs from --warm_start.data_seed {warm.data_seed}: "
                          "the held-out problems could be among the warm start's training problems")
    if run.n_heldout > warm.heldout_reserve:
        raise ConfigError(f"--run.n_heldout {run.n_heldout} is more than --warm_start.heldout_reserve "
                          f"{warm.heldout_reserve}: the held-out problems beyond it were trained on in the warm start")


def _rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{rate:.3f} {kind}" for kind, rate in rates.items())


def _completion_limit(model_path: str) -> int:
    """The model's own hint for a complete answer's length (kept next to a checkpoint we built)."""
    from asyncrl.rl.model import CHAT_MAX_NEW_TOKENS, MARKER_FILE

    try:
        with open(os.path.join(model_path, MARKER_FILE)) as f:
            return int(json.load(f).get("max_new_tokens_hint", CHAT_MAX_NEW_TOKENS))
    except FileNotFoundError:
        return CHAT_MAX_NEW_TOKENS


def _summary_table(summary: dict[str, Any]) -> str:
    rows = [("mode", summary["mode"]), ("steps", summary["steps"]),
            ("held-out solve rate before", _rates(summary["heldout_before"])),
            ("held-out solve rate after", _rates(summary["heldout_after"])),
            ("samples/s", f"{summary['samples_per_s']:.1f}"), ("dropped stale groups", summary["dropped_stale"]),
            ("wall time", f"{summary['wall_s']:.0f} s"), ("checkpoint", summary["checkpoint"])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
