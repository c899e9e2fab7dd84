"""The trainer's side of LoRA (the model side, shared with samplers, is ``rl/model/lora.py``):
the tensors a weight sync sends, and the merged Hugging Face export.

Merged sync: the samplers hold the base model's parameters, under its names; each adapted weight
is sent as ``W + B·A·alpha/rank`` (peft's ``get_delta_weight``), written into a buffer of the base
weight's dtype that is made once and refreshed before each sync. Those buffers cost one copy of
the adapted weights (in the base's dtype: with --trainer.lora.bf16_base, 2 bytes a parameter),
the price of syncing to a sampler that knows nothing of LoRA. Adapter-only sync needs none.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from asyncrl.rl.config.trainer import LoRAConfig
from asyncrl.rl.model.lora import ADAPTER, adapter_tensors

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel


class MergedWeights:
    """The base model's parameters by their base names, the adapted ones merged. ``tensors()``
    refreshes the merged buffers and returns the same tensor objects every time (so the weight
    sender's copy plan is reused)."""

    def __init__(self, model: PeftModel):
        from peft.tuners.lora import LoraLayer

        self.layers: list[tuple[LoraLayer, torch.Tensor]] = []
        self._tensors: dict[str, torch.Tensor] = {}
        adapted = {
            f"{name}.base_layer.weight": module
            for name, module in model.get_base_model().named_modules()
            if isinstance(module, LoraLayer)
        }
        for name, p in model.get_base_model().named_parameters():
            if ".lora_" in name:
                continue
            layer = adapted.get(name)
            if layer is not None:
                merged = torch.empty_like(p, requires_grad=False)
                self.layers.append((layer, merged))
                p = merged
            self._tensors[name.replace(".base_layer.", ".")] = p

    @torch.no_grad()
    def tensors(self) -> dict[str, torch.Tensor]:
        for layer, merged in self.layers:
            base = layer.get_base_layer().weight
            merged.copy_(base.float() + layer.get_delta_weight(ADAPTER).float())
        return self._tensors


def sync_tensors(model: PeftModel, mode: str, merged: MergedWeights | None) -> dict[str, torch.Tensor]:
    """What a sync sends: the adapters (``adapter``) or the merged weights (``merged``)."""
    if mode == "adapter":
        return adapter_tensors(model)
    if merged is None:
        raise ValueError("--trainer.lora.sync merged: the merged weights were not built")
    return merged.tensors()


def merged_copy(model: PeftModel) -> PreTrainedModel:
    """A plain transformers model with the adapters merged in (the trained model itself is left
    as it is): what a final export writes for transformers and vLLM."""
    return copy.deepcopy(model).merge_and_unload()


def save_merged(model: PeftModel, folder: str, whole: dict[str, torch.Tensor] | None) -> None:
    """Write the policy with its adapters merged in as a Hugging Face directory (for transformers
    and vLLM). ``whole``: the PeftModel's state dict gathered from the shards (a rank group's
    rank 0; ``W + B·A·scaling`` is taken here, over whole tensors: our adapters are plain LoRA,
    ``peft_config``); None: ``model`` is whole."""
    if whole is None:
        merged_copy(model).save_pretrained(folder, safe_serialization=True)
        return
    from peft.tuners.lora import LoraLayer

    from asyncrl.rl.trainer.fsdp import save_pretrained

    prefix = "base_model.model."
    merged = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        a, b = whole[f"{name}.lora_A.{ADAPTER}.weight"], whole[f"{name}.lora_B.{ADAPTER}.weight"]
        base = whole[f"{name}.base_layer.weight"]
        merged[f"{name}.base_layer.weight"] = (base.float() + (b.float() @ a.float()) * module.scaling[ADAPTER]).to(
            base.dtype
        )
    out = {}
    for key, tensor in whole.items():
        if ".lora_" in key:
            continue
        out[key.removeprefix(prefix).replace(".base_layer.", ".")] = merged.get(key, tensor)
    save_pretrained(model.get_base_model(), folder, out)


def lora_policy(
    model: PreTrainedModel, lora: LoRAConfig, device: torch.device, adapter_dir: str | None = None
) -> PeftModel:
    """The policy to train: ``model`` as a frozen base (bf16 on GPU with ``lora.bf16_base``) with
    fresh adapters, or with those saved in ``adapter_dir`` (a checkpoint's, to resume)."""
    from asyncrl.rl.model.lora import attach_adapter, load_adapter

    if lora.bf16_base and device.type == "cuda":
        model = model.to(torch.bfloat16)
    if adapter_dir is None:
        return attach_adapter(model, lora)
    return load_adapter(model, adapter_dir, trainable=True)
