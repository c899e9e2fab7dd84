"""The one factory above the sampler backends: `choose_backend` resolves ``auto``, `make_backend`
builds the one chosen (and loads what it needs of the checkpoint). The implementations never
import each other; only this module knows them all, and imports each lazily (transformers and
vLLM are heavy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.rl.sampler.backend import SamplerBackend
from asyncrl.rl.sampler.errors import SamplerError

if TYPE_CHECKING:
    from asyncrl.rl.config.trainer import LoRAConfig
    from asyncrl.rl.model.policy import PromptFormat

BACKENDS = ("auto", "vllm", "hf")


def choose_backend(name: str, device: torch.device) -> str:
    """``"vllm"`` or ``"hf"``. ``"auto"`` is vLLM on a GPU where a CUDA build imports, else Hugging
    Face: on the CPU too, where vLLM's CPU build samples the embedded model slower than HF, starts
    slower, and made the README's run slower (docs/vllm.md has the figures); it is there
    when asked for (``"vllm"``). An explicit ``"vllm"`` that is not usable raises
    `SamplerError` saying why."""
    if name not in BACKENDS:
        raise ValueError(f"sampler backend must be one of {BACKENDS}, not {name!r}")
    if name == "hf" or (name == "auto" and torch.device(device).type == "cpu"):
        return "hf"
    from asyncrl.rl.sampler.vllm.backend import vllm_unusable

    why = vllm_unusable(device)
    if not why:
        return "vllm"
    if name == "vllm":
        raise SamplerError(f"sampler backend vllm was asked for, but {why}")
    return "hf"


def make_backend(
    name: str,
    model_path: str,
    *,
    device: torch.device,
    seed: int = 0,
    in_flight: bool = False,
    resume_timeout_s: float = 600.0,
    vllm: Mapping[str, Any] = {},
    adapter: LoRAConfig | None = None,
) -> tuple[SamplerBackend, PromptFormat]:
    """The backend ``name`` stands for (`choose_backend`) on the checkpoint at ``model_path``, and
    the checkpoint's prompt format. ``in_flight``: weights will be taken between decoding steps
    (vLLM then keeps no prefix cache, unless ``vllm`` says otherwise). ``resume_timeout_s``: how
    long a generate waits out a pause. ``vllm``: extra keyword arguments of `VLLMBackend`.
    ``adapter``: the policy carries these LoRA adapters (peft; vLLM: its own LoRA path), and weight
    syncs bring only them."""
    kind = choose_backend(name, device)
    if kind == "vllm":  # the engine loads the model itself: only the tokenizer here
        from asyncrl.rl.model.policy import load_prompt_format
        from asyncrl.rl.sampler.vllm.backend import VLLMBackend

        tokenizer, fmt = load_prompt_format(model_path)
        # An adapter sync changes no weight under a running batch: the prefix cache stays valid.
        options = {"prefix_caching": not in_flight or adapter is not None} | dict(vllm)
        return VLLMBackend(
            model_path,
            tokenizer=tokenizer,
            seed=seed,
            device=device,
            resume_timeout_s=resume_timeout_s,
            adapter=adapter,
            **options,
        ), fmt
    from asyncrl.rl.model.policy import load_policy
    from asyncrl.rl.sampler.hf import HFBackend

    model, tokenizer, fmt = load_policy(model_path, device, torch.float32)
    if adapter is not None:
        from asyncrl.rl.model.lora import attach_adapter

        model = attach_adapter(model, adapter)
    return HFBackend(
        model, tokenizer=tokenizer, seed=seed, resume_timeout_s=resume_timeout_s, adapter_only=adapter is not None
    ), fmt
