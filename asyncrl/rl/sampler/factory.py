"""The one factory above the sampler backends: `choose_backend` resolves ``auto``, `backend_class`
picks the class of the one chosen, once, and `make_backend` builds it (`SamplerBackend.load`: it
loads what it needs of the checkpoint). The implementations never import each other; only this
module knows them all, and imports each lazily (transformers and vLLM are heavy): no other module
compares a backend's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.rl.sampler.backend import BackendOptions, SamplerBackend
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
    from asyncrl.rl.sampler.vllm.engine_setup import vllm_unusable

    why = vllm_unusable(device)
    if not why:
        return "vllm"
    if name == "vllm":
        raise SamplerError(f"sampler backend vllm was asked for, but {why}")
    return "hf"


def backend_class(name: str, device: torch.device) -> type[SamplerBackend]:
    """The class of the backend ``name`` stands for on ``device`` (`choose_backend`)."""
    if choose_backend(name, device) == "vllm":
        from asyncrl.rl.sampler.vllm.backend import VLLMBackend

        return VLLMBackend
    from asyncrl.rl.sampler.hf import HFBackend

    return HFBackend


def make_backend(
    name: str,
    model_path: str,
    *,
    device: torch.device,
    seed: int = 0,
    in_flight: bool = False,
    resume_timeout_s: float = 600.0,
    vllm: Mapping[str, Any] | None = None,
    adapter: LoRAConfig | None = None,
) -> tuple[SamplerBackend, PromptFormat]:
    """The backend ``name`` stands for (`choose_backend`) on the checkpoint at ``model_path``, and
    the checkpoint's prompt format: `backend_class`'s `SamplerBackend.load` with these
    `BackendOptions`."""
    options = BackendOptions(device, seed, in_flight, resume_timeout_s, dict(vllm or {}), adapter)
    return backend_class(name, device).load(model_path, options)
