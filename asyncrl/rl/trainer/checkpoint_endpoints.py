"""`CheckpointEndpoints`: the trainer actor's calls that write it to disk and read it back.

A resumable checkpoint (`save_checkpoint`, `load_checkpoint`) is written and loaded in the layout
of the trainer's strategy (``trainer/parallel.py``); `save` writes the policy alone as a Hugging
Face checkpoint directory. The files themselves are ``trainer/checkpoint.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os

from asyncrl.runtime.actor import Actor, endpoint


class CheckpointEndpoints(Actor):
    """Checkpoints and the saved policy. The actor provides ``config``, ``model``, ``tokenizer``,
    ``model_path``, ``steps``, ``sender``, ``parallel`` (its strategy, which loads a checkpoint
    through the actor's ``_policy`` and ``_new_optimizer``), ``rank`` and ``_run`` (a call off the
    event loop, on every rank of a group)."""

    @endpoint
    async def save_checkpoint(
        self, run_dir: str, step: int, keep: int, run_state: bytes, deadline_s: float = 0.0
    ) -> str:
        """Write the resumable checkpoint of ``step`` under ``run_dir`` (policy, optimiser, RNGs
        and the driver's ``run_state`` JSON), atomically, keeping the newest ``keep``; returns
        its path (on a rank group rank 0's; the others return ""). See ``trainer/checkpoint.py``."""
        return await self._run(
            f"writing the checkpoint of step {step}",
            deadline_s,
            self.parallel.write_checkpoint,
            self,
            run_dir,
            step,
            keep,
            run_state,
        )

    @endpoint
    async def load_checkpoint(self, path: str, deadline_s: float = 0.0) -> int:
        """Take the policy, optimiser state and RNG states of the checkpoint at ``path`` (before
        the weight-sync group is formed); returns the trainer's step count there."""

        def load() -> int:
            self.steps = self.parallel.load_checkpoint(self, path)
            self.sender = None  # it held the old parameters: set up again with the group
            return self.steps

        return await self._run("loading the checkpoint", deadline_s, load)

    @endpoint
    async def save(self, path: str, extra_files: dict[str, str] | None = None, deadline_s: float = 0.0) -> str:
        """Write the policy as a Hugging Face checkpoint directory, whole (`staged_dir`: a kill
        at any point leaves a whole policy, the old or the new, never a half-written or
        half-deleted one), with ``extra_files`` (name -> text, e.g. best.json) inside it, written
        with the rest so they never describe another policy. A failed write (a full disk) leaves
        nothing behind and raises a one-line `CheckpointWriteError`. With a rank group, every
        rank gathers the policy (a tensor at a time, to rank 0's memory) and rank 0 writes it."""
        return await self._run(
            "saving the policy", deadline_s, self._save, os.path.abspath(path), dict(extra_files or {})
        )

    def _save(self, final: str, extra_files: dict[str, str]) -> str:
        from asyncrl.rl.trainer.checkpoint import write_policy

        whole = self.parallel.policy_state_dict(self.model)  # None: the model in this process is whole
        if self.rank != 0:
            return ""
        state = {"steps": self.steps, "config": dataclasses.asdict(self.config)}
        files = {"asyncrl_trainer.json": json.dumps(state, indent=2)}
        files.update((os.path.basename(name), text) for name, text in extra_files.items())
        return write_policy(
            final,
            self.model,
            self.tokenizer,
            whole=whole,
            lora=bool(self.config.lora.rank),
            markers=self._marker_files(),
            files=files,
        )

    def _marker_files(self) -> list[str]:
        """The warm start's marker file of the policy's directory, if it has one: copied into every
        policy and checkpoint written, so they load with the same prompt style."""
        from asyncrl.rl.model.policy import MARKER_FILE

        marker = os.path.join(self.model_path, MARKER_FILE)
        return [marker] if os.path.exists(marker) else []
