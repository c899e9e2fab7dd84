"""LoRA adapters on a policy, with peft (the maintained library; we write no LoRA layers): the
adapter config from ours, attaching adapters to a loaded model, and the adapter's own tensors.

Trainer and samplers attach adapters with the same `LoRAConfig` to the same base checkpoint, so
peft gives their adapter tensors the same names and shapes: that is what lets an adapter-only
weight sync agree on its layout without sending anything but the tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.rl.config.trainer import LoRAConfig

ADAPTER = "default"
"""peft's name of the one adapter a policy carries."""


def peft_config(lora: LoRAConfig) -> Any:
    """peft's ``LoraConfig`` of ours, for a causal LM."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_adapter(model: Any, lora: LoRAConfig) -> Any:
    """``model`` (a transformers causal LM) with fresh adapters (B = 0: the policy is unchanged),
    its base frozen; a `peft.PeftModel`. Adapters are fp32 whatever the base's dtype (peft's
    ``autocast_adapter_dtype``), so a bf16 base trains fp32 adapters."""
    from peft import get_peft_model

    missing = set(lora.target_modules) - {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if missing:
        raise ValueError(f"--trainer.lora.target_modules names modules this model does not have: {sorted(missing)}")
    with _peft_reads_is_gradient_checkpointing():
        return get_peft_model(model, peft_config(lora))


def load_adapter(model: Any, adapter_dir: str, trainable: bool) -> Any:
    """``model`` with the adapter saved (peft's format) in ``adapter_dir``."""
    from peft import PeftModel

    with _peft_reads_is_gradient_checkpointing():
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable)


@contextlib.contextmanager
def _peft_reads_is_gradient_checkpointing() -> Iterator[None]:
    """peft (0.21.2, the newest release tested) reads ``model.is_gradient_checkpointing``
    each time it wraps a model, a property transformers 5.23 deprecated for
    ``is_activation_checkpointing``: that FutureWarning is about peft's call, not ours, and
    nothing here can act on it. Only it is silenced, and only around peft's wrapping."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's A and B matrices of a `PeftModel`, by their parameter names (identical in
    every process that attached the same config to the same base)."""
    return {name: p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}
