"""What the trainer says when its device runs out of memory: `TrainerMemoryError`, worded by
what the user can change (a smaller micro-batch, checkpointing, packing, LoRA, more GPUs).

A micro-batch that does not fit is one step's failure: its partial gradients and the allocator's
cached blocks are dropped so that the actor goes on serving (`micro_batch_error`). A policy, its
KL reference or its optimiser state that does not fit fits at no micro-batch (`does_not_fit`).
"""

from __future__ import annotations

import torch

from asyncrl.errors import ActionableError


class TrainerMemoryError(ActionableError):
    """A micro-batch did not fit in the trainer's device memory; the message names the settings
    that make it fit. It reaches the driver as itself (`AsyncrlError`)."""


def micro_batch_error(
    exc: torch.OutOfMemoryError,
    *,
    step: int,
    shape: tuple[int, ...],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    micro_batch_tokens: int,
    auto_tokens: int,
) -> TrainerMemoryError:
    """Drop the step's partial gradients and cached blocks (the actor goes on serving) and say
    which settings make a micro-batch of ``shape`` (rows, length) in train step ``step`` smaller
    or cheaper. ``micro_batch_tokens``: the flag's value; ``auto_tokens``: auto's choice for 0."""
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows, length = shape
    budget = f"{micro_batch_tokens}" if micro_batch_tokens else f"0, auto -> {auto_tokens}"
    return TrainerMemoryError(
        f"train step {step} ran out of {device.type} memory on a micro-batch of {rows} x {length} "
        f"tokens (--trainer.micro_batch_tokens {budget}): set it lower, or set "
        f"--trainer.activation_checkpointing, --trainer.pack_tokens or --trainer.lora.rank (docs/trainer.md). "
        f"torch: {_first_line(exc)}"
    )


def does_not_fit(
    what: str, model_path: str, device: torch.device, exc: torch.OutOfMemoryError | None = None
) -> TrainerMemoryError:
    """``what`` (of the policy at ``model_path``) is too large for the trainer's device at any
    micro-batch: say what trains less."""
    where = device.type
    if where == "cuda":
        torch.cuda.empty_cache()
        where = f"GPU's {torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"
    return TrainerMemoryError(
        f"{what} of {model_path} does not fit in the trainer's {where} (full fine-tuning holds 16 bytes a "
        "parameter: fp32 weights, gradients and AdamW's two moments): train LoRA adapters (--trainer.lora.rank 16 "
        "--trainer.lora.bf16_base true), or shard the trainer over GPUs (--trainer.world_size N; docs/trainer.md)."
        + (f" torch: {_first_line(exc)}" if exc is not None else "")
    )


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
