"""The device an actor of a run computes on, set up once at its start."""

from __future__ import annotations

import torch


def actor_device(device: str) -> torch.device:
    """``device`` as the actor uses it: a GPU as ``cuda:0`` (the actor sees only its own through
    CUDA_VISIBLE_DEVICES), made the current device, with cuDNN's attention kernels switched off.

    Why cuDNN's attention is off: PyTorch's SDPA prefers it on Hopper, and it builds an execution
    plan for every new (batch, length) shape. A run's batches change shape at nearly every step
    (completion lengths vary), so each new shape paid the build: a scorer pass and a training
    step on new shapes took several times as long as on shapes seen before. Flash and
    memory-efficient attention need no plan and run new shapes about as fast as seen ones
    (benchmarks/README.md, "Attention on new shapes", has the figures).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        torch.backends.cuda.enable_cudnn_sdp(False)
    return dev
