"""`Checkpointing`: the trainer writing its policy to disk and reading it back.

A resumable checkpoint (`write`, `load`) is written and loaded in the layout of the trainer's
strategy (``trainer/parallel.py``); `save` writes the policy alone as a Hugging Face checkpoint
directory. The files themselves are ``trainer/checkpoint.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

from asyncrl.rl.trainer.policy import TrainedPolicy
from asyncrl.rl.trainer.rank_member import RankMember


class Checkpointing:
    """Checkpoints and the saved policy of ``policy``. ``ranks`` runs each call (on every rank of
    a group); ``loaded`` is told when a checkpoint replaced the parameters (the weight sender
    that held the old ones is dropped)."""

    def __init__(self, ranks: RankMember, policy: TrainedPolicy, loaded: Callable[[], None]):
        self.ranks, self.policy, self.loaded = ranks, policy, loaded

    async def write(self, run_dir: str, step: int, keep: int, run_state: bytes, deadline_s: float) -> str:
        """Write the resumable checkpoint of ``step`` under ``run_dir`` (policy, optimiser, RNGs
        and the driver's ``run_state`` JSON), atomically, keeping the newest ``keep``; returns
        its path (on a rank group rank 0's; the others return ""). See ``trainer/checkpoint.py``."""
        return await self.ranks.run(
            f"writing the checkpoint of step {step}",
            deadline_s,
            self.ranks.parallel.write_checkpoint,
            self.policy,
            run_dir,
            step,
            keep,
            run_state,
        )

    async def load(self, path: str, deadline_s: float) -> int:
        """Take the policy, optimiser state and RNG states of the checkpoint at ``path`` (before
        the weight-sync group is formed); returns the trainer's step count there."""

        def load() -> int:
            self.policy.steps = self.ranks.parallel.load_checkpoint(self.policy, path)
            self.loaded()
            return self.policy.steps

        return await self.ranks.run("loading the checkpoint", deadline_s, load)

    async def save(self, path: str, extra_files: dict[str, str] | None, deadline_s: float) -> str:
        """Write the policy as a Hugging Face checkpoint directory, whole (`staged_dir`: a kill
        at any point leaves a whole policy, the old or the new, never a half-written or
        half-deleted one), with ``extra_files`` (name -> text, e.g. best.json) inside it, written
        with the rest so they never describe another policy. A failed write (a full disk) leaves
        nothing behind and raises a one-line `CheckpointWriteError`. With a rank group, every
        rank gathers the policy (a tensor at a time, to rank 0's memory) and rank 0 writes it."""
        return await self.ranks.run(
            "saving the policy", deadline_s, self._save, os.path.abspath(path), dict(extra_files or {})
        )

    def _save(self, final: str, extra_files: dict[str, str]) -> str:
        from asyncrl.rl.trainer.checkpoint import write_policy

        policy, parallel = self.policy, self.ranks.parallel
        whole = parallel.policy_state_dict(policy.model)  # None: the model in this process is whole
        if parallel.rank != 0:
            return ""
        state = {"steps": policy.steps, "config": dataclasses.asdict(policy.config)}
        files = {"asyncrl_trainer.json": json.dumps(state, indent=2)}
        files.update((os.path.basename(name), text) for name, text in extra_files.items())
        return write_policy(
            final,
            policy.model,
            policy.tokenizer,
            whole=whole,
            lora=bool(policy.config.lora.rank),
            markers=policy.marker_files(),
            files=files,
        )
