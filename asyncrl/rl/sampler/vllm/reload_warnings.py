"""vLLM's in-place reload (the CPU path of weight sync, `worker.py`) warns on every sync for layers
that no checkpoint loads, and logs its timing on every sync: the filters that quiet exactly those."""

from __future__ import annotations

import logging

import torch

from asyncrl.rl.sampler.vllm import compat

RELOAD_LOGGER = compat.RELOAD_LOGGER
RELOAD_WARNING = "%s: Failed to load weights"
RELOAD_TIMING = "Reloading and processing weights took %.2f seconds"


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<layer class>: Failed to load weights" for the layer classes in ``quiet``."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (record.msg == RELOAD_WARNING and isinstance(args, tuple) and bool(args) and args[0] in self.quiet)


class _ReloadTiming(logging.Filter):
    """Drops vLLM's per-reload timing line: one a sync, a line a training step in the run's output
    (the sync's time is in metrics.jsonl as ``sync_s``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != RELOAD_TIMING


def quiet_reload_warnings(model: torch.nn.Module, sent: set[str]) -> None:
    """Silence, for this model, the warnings vLLM's in-place reload gives on every sync for layers
    that no checkpoint can load. Its layerwise reload counts every tensor of a layer, buffers
    included, and warns for each layer none of whose tensors came in, then puts back the tensors
    it had, which is right for these: a layer whose tensors are all non-persistent buffers
    (computed at start, never saved: rotary's cos/sin cache, `RotaryEmbedding`) or parameters of
    another layer that was sent (tied: ``lm_head.weight`` is ``model.embed_tokens.weight``, and
    Qwen2's loader skips ``lm_head.*`` when tied, so sending it would not help). vLLM's own reload
    from the checkpoint warns the same. A class is silenced only if every layer of it is such a
    layer; any other failure to load still warns."""
    holders: dict[int, set[str]] = {}  # parameter -> every name it has in the model
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), set()).add(f"{prefix}.{name}" if prefix else name)
    expected: dict[str, bool] = {}
    for prefix, module in model.named_modules():
        params = {f"{prefix}.{n}" if prefix else n: p for n, p in module._parameters.items() if p is not None}
        buffers = {n for n, b in module._buffers.items() if b is not None}
        if not params and not buffers:
            continue  # nothing to load: vLLM does not warn
        saved = buffers - module._non_persistent_buffers_set
        tied = all((holders[id(p)] - {name}) & sent for name, p in params.items())
        kind = type(module).__name__
        expected[kind] = expected.get(kind, True) and not saved and tied
    logger = logging.getLogger(RELOAD_LOGGER)
    quiet = next((f for f in logger.filters if isinstance(f, _ExpectedReloadWarnings)), None)
    if quiet is None:
        quiet = _ExpectedReloadWarnings()
        logger.addFilter(quiet)
    quiet.quiet = {kind for kind, ok in expected.items() if ok}
    timing = logging.getLogger(compat.RELOAD_TIMING_LOGGER)
    if not any(isinstance(f, _ReloadTiming) for f in timing.filters):
        timing.addFilter(_ReloadTiming())
