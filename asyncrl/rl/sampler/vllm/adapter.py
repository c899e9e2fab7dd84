"""LoRA adapters in a vLLM sampler: adapter-only weight syncs through vLLM's own LoRA path.

The trainer sends only the adapters' A and B matrices (``--trainer.lora.sync adapter``). Here they
are received by the sampler actor itself (`ActorSink`, as for the HF backend: megabytes, not the
model), written as a peft adapter directory in the backend's scratch directory, and loaded by the
engine as a new `LoRARequest` (a new id per sync). A batch keeps the adapter it began with to its
end (its log-probs are those of one policy); an adapter no running batch uses any more is removed
from the engine and its directory deleted, so at most two are loaded at a time.

The tensors' names and shapes are those peft gives the trainer's adapters on the same base: they
are found by attaching the adapters to the checkpoint's architecture on the meta device, so the
layout check of the sync compares like with like without loading any weight here.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncrl.rl.config.trainer import LoRAConfig

ENGINE_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank``."""


def engine_lora_options(lora: LoRAConfig) -> dict[str, Any]:
    """`AsyncEngineArgs` fields for adapters of ``lora``: the smallest rank bound vLLM accepts that
    holds them, and room for two (the current one and the one a batch still finishing uses)."""
    bound = next((r for r in ENGINE_MAX_RANKS if r >= lora.rank), None)
    if bound is None:
        raise ValueError(f"vLLM serves LoRA ranks up to {ENGINE_MAX_RANKS[-1]}, not {lora.rank}")
    return {"enable_lora": True, "max_lora_rank": bound, "max_loras": 2}


def lora_dtype_refusal(dtype: Any, device_type: str) -> str:
    """Why an engine of ``dtype`` cannot serve adapters on ``device_type``, or "": on a GPU vLLM's
    LoRA kernels (Triton) take fp16 and bf16 only, and an fp32 engine dies at its first adapted
    batch. "auto" is fine: vLLM runs an fp32 checkpoint in bf16 there."""
    if device_type != "cpu" and str(dtype).removeprefix("torch.") in ("float32", "float"):
        return (
            "vLLM serves LoRA adapters on a GPU in fp16 or bf16 only; this engine was asked for float32: "
            "leave its dtype to vLLM, or sync merged weights (--trainer.lora.sync merged)"
        )
    return ""


def adapter_skeleton(model_path: str, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """Zeroed fp32 tensors named and shaped as the adapters peft attaches with ``lora`` to the
    checkpoint at ``model_path`` (what `asyncrl.rl.model.lora.adapter_tensors` gives the trainer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.rl.model.lora import adapter_tensors, attach_adapter

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = attach_adapter(AutoModelForCausalLM.from_config(config), lora)
    return {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in adapter_tensors(model).items()}


class EngineAdapters:
    """The adapter tensors a sync writes into, and the engine's adapters made from them.
    `weight_tensors` and `load_weights` are what `ActorSink` needs of a backend."""

    def __init__(self, engine: Any, model_path: str, lora: LoRAConfig, root: str, on_loaded: Callable[[int], None]):
        self.engine = engine
        self.on_loaded = on_loaded  # told each version made current: the one new batches begin with
        self.lora = lora
        self.root = root
        self.tensors = adapter_skeleton(model_path, lora)
        self.current: Any = None  # the LoRARequest new batches use; None: the base model (B = 0)
        self.serial = 0
        self.users: dict[int, int] = {}  # adapter id -> batches running with it
        self.loaded: dict[int, str] = {}  # adapter id -> its directory

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.tensors

    async def load_weights(
        self,
        load: Callable[[Mapping[str, torch.Tensor]], object],
        *,
        version: int,
        in_flight: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        """Receive into the tensors (``load``), then make them the engine's next adapter. Running
        batches are not disturbed whatever ``in_flight`` says: they end on the adapter they began
        with. A failed sync leaves the current adapter in place (the tensors may be half-written;
        the next good sync rewrites them all)."""
        await asyncio.to_thread(load, self.tensors)
        from vllm.lora.request import LoRARequest

        self.serial += 1
        path = os.path.join(self.root, f"adapter-{self.serial}")
        await asyncio.to_thread(self._write, path)
        request = LoRARequest(f"asyncrl-{self.serial}", self.serial, path)
        await asyncio.wait_for(self.engine.add_lora(request), timeout_s)  # loaded now, not by the next batch
        previous, self.current = self.current, request
        self.loaded[request.lora_int_id] = path
        self.on_loaded(version)  # running batches keep their adapter, and with it their version
        if previous is not None:
            await self._drop_if_unused(previous.lora_int_id)

    def acquire(self) -> Any:
        """The adapter a batch starting now uses (None: the base model), counted until `release`."""
        if self.current is not None:
            self.users[self.current.lora_int_id] = self.users.get(self.current.lora_int_id, 0) + 1
        return self.current

    async def release(self, request: Any) -> None:
        if request is None:
            return
        self.users[request.lora_int_id] -= 1
        await self._drop_if_unused(request.lora_int_id)

    async def _drop_if_unused(self, lora_id: int) -> None:
        if self.users.get(lora_id, 0) or (self.current is not None and self.current.lora_int_id == lora_id):
            return
        self.users.pop(lora_id, None)
        path = self.loaded.pop(lora_id, None)
        try:
            await asyncio.wait_for(self.engine.remove_lora(lora_id), 30.0)
        except Exception as exc:  # a dead engine holds nothing any more
            print(f"VLLMBackend: removing LoRA adapter {lora_id} failed: {exc!r}", flush=True)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def _write(self, path: str) -> None:
        """The tensors as peft saves an adapter: adapter_config.json and adapter_model.safetensors
        with the adapter's name left out of the tensor names (vLLM reads that format)."""
        from safetensors.torch import save_file

        from asyncrl.rl.model.lora import ADAPTER, peft_config

        os.makedirs(path, exist_ok=True)
        peft_config(self.lora).save_pretrained(path)
        save_file(
            {name.replace(f".{ADAPTER}.", "."): t.contiguous() for name, t in self.tensors.items()},
            os.path.join(path, "adapter_model.safetensors"),
        )
