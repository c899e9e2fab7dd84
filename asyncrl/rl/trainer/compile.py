"""``--trainer.compile``: torch.compile each decoder layer of the policy, in place.

Per layer, not the whole model (torchtitan compiles its blocks the same way): a layer is the unit
that repeats, so it compiles once and every layer reuses the code; the model's own forward (mask
building, the embedding, the fused output layer of ``scoring.py``) stays eager. Shapes change with
every micro-batch (rows, lengths), so the layers are compiled for dynamic shapes from the start
instead of recompiling for each new length. Dynamic shapes alone still recompiled mid-run (a
micro-batch of one row, one without padding, sizes equal at the first compile): `compile_layers`
and ``scoring/forward.py``'s `layout_inputs` keep the layers' calls alike (docs/trainer.md).

Only the training forward runs compiled: generation in the trainer's process (the held-out
evaluation) runs the same layers eagerly (`eager`). With a KV cache each layer's call differs in
the cache's state, so dynamo recompiled layer after layer until its recompile limit, and past the
limit it runs that code eagerly for good, training included: a GRPO run on a GPU whose first
evaluation came before its first step trained as if never compiled (same step time and peak
memory as without: docs/trainer.md, benchmarks/README.md issue 29).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.fx.experimental._config

from asyncrl.rl.scoring.forward import MIN_ROWS

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CompileError(ValueError):
    """The model has no decoder layers this can find."""


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The model's decoder layers (a transformers causal LM, LoRA-wrapped or not)."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise CompileError(
            f"--trainer.compile: {type(model).__name__} has no decoder layers to compile "
            "(get_decoder().layers); set --trainer.compile false"
        )
    return layers


def compile_layers(model: PreTrainedModel, backend: str | Callable = "inductor") -> int:
    """Compile each decoder layer in place; returns how many. ``backend``: torch.compile's (tests
    count graphs with a cheaper one). The model's forward then gives the layers at least two rows
    (`MIN_ROWS`): dynamo specialises a dimension of size 1 even for dynamic shapes, so a micro-batch
    of one row recompiled every layer's code mid-run (``scoring/forward.py``'s `layout_inputs`)."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
        compiled = layer._compiled_call_impl
        if compiled is None:  # torch's Module.compile sets it
            raise CompileError(f"--trainer.compile: {type(layer).__name__}.compile() left no compiled call")
        layer._compiled_call_impl = _distinct_sizes(compiled)
    setattr(model, MIN_ROWS, 2)
    return len(layers)


def _distinct_sizes(call: Callable) -> Callable:
    """``call`` compiled without duck sizing. With it, dynamo gives sizes that are equal at the
    first compile one symbol, and guards on that: a first micro-batch whose length equalled its
    row count, or the head dim or hidden size, recompiled at the first micro-batch where they
    differed (``hidden_states.size()[1] == hidden_states.size()[0]  # duck sizing added this
    equality``; ``tensor 'hidden_states' size mismatch at index 1. expected 32``). Scoped to the
    layers' calls: a global switch would reach every other compile in the process."""

    @functools.wraps(call)
    def run(*args, **kwargs):
        # `patch` is installed on the module at import (torch's config modules): not in its stubs
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            return call(*args, **kwargs)

    return run


def compiled(config, device: torch.device) -> bool:
    """Whether ``--trainer.compile`` (a `TrainerConfig`) is on for a trainer on ``device``."""
    if config.compile is not None:
        return config.compile
    return device.type == "cuda" and config.world_size == 1


def eager(on: bool = True) -> contextlib.AbstractContextManager:
    """Run compiled code eagerly inside (when ``on``): for generation (see the module docstring)."""
    return torch.compiler.set_stance("force_eager") if on else contextlib.nullcontext()
