"""The device an actor of a run computes on, set up once at its start."""

from __future__ import annotations

import torch


def actor_device(device: str) -> torch.device:
    """``device`` as the actor uses it: a GPU as ``cuda:0`` (the actor sees only its own through
    CUDA_VISIBLE_DEVICES), made the current device, with cuDNN's attention kernels switched off.

    Why cuDNN's attention is off: PyTorch's SDPA prefers it on Hopper, and it builds an execution
    plan for every new (batch, length) shape. A run's batches change shape at nearly every step
    (completion lengths vary), so each new shape paid the build: on an H200 with the 0.5B shape,
    a scorer pass of new shapes took 69 ms against 20 ms once seen, and a training forward and
    backward 212 ms (up to 1.9 s) against 89 ms. Flash and memory-efficient attention need no
    plan: 19-22 ms and 102 ms on new shapes (benchmarks/README.md, "Attention on new shapes").
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        torch.backends.cuda.enable_cudnn_sdp(False)
    return dev
