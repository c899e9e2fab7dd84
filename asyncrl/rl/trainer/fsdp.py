"""FSDP2 for the trainer's policy: sharding it over the rank group, clipping its gradient, and
gathering it back whole (for an export or a digest), all on torch's own FSDP2 / DCP APIs.

Sharding follows torchtitan's recipe: `fully_shard` on each decoder layer, then on the root (the
embeddings, the final norm and the head, tied or not). Parameters stay fp32 (the optimiser's
master copy); on GPU each layer's weights are gathered in bf16 for its forward and backward and
gradients are reduce-scattered in fp32 (`MixedPrecisionPolicy`). Gradients are SUMMED across
ranks, not averaged: each rank's loss is already divided by the global token (or sequence) count
(``trainer/split.py``), so the sum is the gradient one rank would compute on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from asyncrl.errors import AsyncrlError
from asyncrl.rl.scoring.forward import ROUTED_FORWARD

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ShardingError(AsyncrlError):
    """The model cannot be sharded as asked (no decoder layers found, an unsupported layout)."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes transformers names as never to be split
    across devices (``_no_split_modules``: ``Qwen2DecoderLayer`` and the like)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if original_class(m).__name__ in names]
    if not layers:
        raise ShardingError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules "
            f"{sorted(names)}): cannot shard it layer by layer"
        )
    return layers


def shard_model(model: PreTrainedModel, device: torch.device, *, bf16: bool = True) -> PreTrainedModel:
    """Shard ``model`` in place over the default process group (`RankGroup`) and return it. A
    LoRA policy (a peft model) is sharded the same way through its base model: each decoder layer
    (its frozen weights and its adapters, one unit), then the base model as the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    world = dist.group.WORLD
    if world is None:
        raise ShardingError("no default process group: a policy is sharded after its rank group is formed")
    mesh = DeviceMesh.from_group(world, device.type)
    mixed = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda" and bf16
        else MixedPrecisionPolicy()
    )
    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    for layer in decoder_layers(root):
        fully_shard(layer, mesh=mesh, mp_policy=mixed)
    fully_shard(root, mesh=mesh, mp_policy=mixed)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum (see the module docstring) ...
            module.set_force_sum_reduction_for_comms(True)  # ... as a plain SUM (gloo has no PREMUL_SUM)
    # transformers' generate() then runs every rank's forward passes in step (``synced_gpus``),
    # which a sharded model needs: each forward gathers every rank's shards.
    root._is_fsdp_managed_module = True
    _route_forward(root)
    return model


def _route_forward(root: PreTrainedModel) -> None:
    """Let the root run any computation inside its own forward: ``root(asyncrl_call=fn)`` runs
    ``fn()`` between FSDP2's root hooks, which gather the root's own parameters (embeddings, final
    norm, head) and reduce-scatter their gradients after the backward. The fused head
    (``scoring/logprobs.py``, through `in_root_forward`) calls the decoder and reads the head's
    weight itself; outside the root's forward it would see shards. Any other call is the model's
    own forward (generation)."""
    original = root.forward

    def forward(*args: object, asyncrl_call: Callable[[], object] | None = None, **kwargs: object) -> object:
        return original(*args, **kwargs) if asyncrl_call is None else asyncrl_call()

    root.forward = forward
    setattr(root, ROUTED_FORWARD, True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (sharded) DTensor parameter, gathered from every rank (a collective:
    every rank calls it for the same tensors in the same order); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of sharded parameters to ``max_norm``; returns the norm
    before clipping (torchtitan's approach: the norm of DTensor gradients is reduced across
    ranks, then made a plain tensor)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
    return total


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's CPU (empty on the others); every rank must call it.
    Gathered one tensor at a time, so device memory never holds more than one whole tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: t for name, t in whole.items() if isinstance(t, torch.Tensor)}  # a model's: every value is one


def original_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 swaps in a subclass named ``FSDP<name>``, which no loader knows."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if issubclass(cls, FSDPModule):
        return next(base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule) and base is not object)
    return cls


def save_pretrained(model: PreTrainedModel, folder: str, state_dict: dict[str, torch.Tensor]) -> None:
    """Rank 0: write ``state_dict`` (from `full_state_dict`) as a Hugging Face model directory
    that names the model's own architecture, so transformers and vLLM load it as any checkpoint."""
    architecture = original_class(model).__name__
    model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    import json
    import os

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
