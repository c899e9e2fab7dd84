"""`TrainedPolicy`: the policy a trainer trains, its optimiser, its KL reference and its step count.

The train step, the weight sync (``trainer/weight_sending.py``) and the checkpoints
(``trainer/checkpointing.py``) all read these, and a checkpoint's load replaces the model and the
optimiser under them: one object holds them, so every part sees the current ones. How a policy is
loaded (the whole checkpoint, or with LoRA the start's frozen base with adapters), compiled,
checkpointed and sharded is here too.

The optimiser (and LoRA's merged weights) are built once, over the model as it is trained: whole,
in the constructor, at world size 1; over its shards, at the rank join (`shard`), on a rank of N.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

from asyncrl.rl.config.trainer import TrainerConfig
from asyncrl.rl.scoring import chunked_head
from asyncrl.rl.trainer.compile import compile_layers, compiled
from asyncrl.rl.trainer.errors import RankGroupError
from asyncrl.runtime.startup import start_phase

if TYPE_CHECKING:
    from asyncrl.rl.trainer.lora import MergedWeights


class TrainedPolicy:
    """The policy at ``path`` loaded on ``device`` in train mode, its AdamW optimiser and, with a
    KL term and no LoRA, a frozen second copy as the reference. ``steps``: optimiser steps taken.
    At ``config.world_size`` > 1 the optimiser comes with `shard` (see the module docstring)."""

    def __init__(self, path: str, config: TrainerConfig, device: torch.device):
        self.path, self.config, self.device = path, config, device
        self.steps = 0
        self.merged: MergedWeights | None = None  # LoRA's merged weights (``--trainer.lora.sync merged``)
        self._optimizer: torch.optim.Optimizer | None = None
        if config.compile is False:  # no torch.compile at all: the fused head's chunks stay eager too
            chunked_head.FAST = False
        start_phase(f"loading the policy {path}")
        self.model, self.tokenizer, self.fmt = self.load()
        # The KL term's reference: the starting policy. With LoRA that is the frozen base already
        # in memory (the adapters switched off, `reference`), so no copy is loaded.
        self.ref = None
        if config.loss.kl_coef > 0 and not config.lora.rank:
            start_phase("loading the KL reference (a second copy of the policy)")
            self.ref, _, _ = self._load(path)
            self.ref.eval().requires_grad_(False)
        if config.world_size == 1:
            self._built()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise RankGroupError(
                "the policy is one rank's of a sharded trainer: its optimiser comes with the rank join"
            )
        return self._optimizer

    def _built(self) -> None:
        """What is built over the model as it is trained (whole, or sharded): LoRA's merged
        weights (``--trainer.lora.sync merged``) and the optimiser."""
        lora = self.config.lora
        if lora.rank and lora.sync == "merged":
            from asyncrl.rl.trainer.lora import MergedWeights

            self.merged = MergedWeights(self.model)
        self._optimizer = self.new_optimizer()

    def _load(self, path: str):
        from asyncrl.rl.model.policy import load_policy

        model, tokenizer, fmt = load_policy(path, self.device, torch.float32)
        if self.config.attn_implementation:
            model.set_attn_implementation(self.config.attn_implementation)
        if compiled(self.config, self.device):
            compile_layers(model)
        return model, tokenizer, fmt

    def load(self, checkpoint_dir: str | None = None):
        """The model to train, in train mode: the checkpoint's (or the start's) whole, or with LoRA
        the start's frozen base with fresh adapters (or the checkpoint's, which hold no base)."""
        lora = self.config.lora
        if not lora.rank:
            model, tokenizer, fmt = self._load(checkpoint_dir or self.path)
            return self._checkpointed(model).train(), tokenizer, fmt
        from asyncrl.rl.trainer.lora import lora_policy

        base, tokenizer, fmt = self._load(self.path)
        model = lora_policy(self._checkpointed(base), lora, self.device, checkpoint_dir)
        return model.train(), tokenizer, fmt

    def reload(self, checkpoint_dir: str) -> None:
        """Take the checkpoint's policy (with LoRA, the start's base and the saved adapters) and a
        fresh optimiser over it, for its saved state to be loaded into (world size 1: a rank of N
        loads its shards in place)."""
        self.model, _, _ = self.load(checkpoint_dir)
        self._built()

    def _checkpointed(self, model):
        """``--trainer.activation_checkpointing``: each decoder layer recomputes its activations in
        the backward (transformers' non-reentrant checkpointing, which needs no input that requires
        grad, so a frozen LoRA base works too); FSDP2 shards the layers with it on. transformers
        5.23 renamed ``gradient_checkpointing_enable`` (deprecated since) to
        ``activation_checkpointing_enable``: the new name where the model has it."""
        if self.config.activation_checkpointing:
            checkpoint_layers(model)
        return model

    def shard(self) -> None:
        """Shard the policy (and the KL reference) over the rank group just formed and build the
        optimiser over the shards (`RankMember.join`): once, on a rank of N."""
        from asyncrl.rl.trainer.fsdp import shard_model

        if self._optimizer is not None:
            raise RankGroupError("the policy was built whole (world size 1): it cannot be sharded now")
        shard_model(self.model, self.device, bf16=self.config.bf16)
        if self.ref is not None:
            shard_model(self.ref, self.device, bf16=self.config.bf16)
        self._built()

    def new_optimizer(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        # fused: one kernel for every parameter's update on a GPU (torch's own); elsewhere its default
        return torch.optim.AdamW(
            trainable,
            lr=self.config.peak_lr(),
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
            fused=self.device.type == "cuda" or None,
        )

    @contextlib.contextmanager
    def reference(self):
        """The KL reference to score with: the loaded copy, or with LoRA the policy itself with its
        adapters disabled for the duration (peft's ``disable_adapter``: the frozen base)."""
        if self.ref is not None:
            yield self.ref
        else:
            with self.model.disable_adapter():
                yield self.model

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends: every parameter; with LoRA, the merged weights under the base
        model's names, or the adapters alone (``--trainer.lora.sync``, ``trainer/lora.py``)."""
        if not self.config.lora.rank:
            return dict(self.model.named_parameters())
        from asyncrl.rl.trainer.lora import sync_tensors

        return sync_tensors(self.model, self.config.lora.sync, self.merged)

    def marker_files(self) -> list[str]:
        """The warm start's marker file of the policy's directory, if it has one: copied into every
        policy and checkpoint written, so they load with the same prompt style."""
        from asyncrl.rl.model.policy import MARKER_FILE

        marker = os.path.join(self.path, MARKER_FILE)
        return [marker] if os.path.exists(marker) else []


def checkpoint_layers(model) -> None:
    """Each decoder layer of ``model`` recomputes its activations in the backward, from its next
    forward on (`PolicyHolder._checkpointed`; also once a long sequence asks for it, actor.py)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 5.0 to 5.22
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
