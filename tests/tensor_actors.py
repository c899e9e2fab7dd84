"""Actors that import torch (kept apart so that other tests' actors start fast)."""

from __future__ import annotations

import numpy as np
import torch

from asyncrl import Actor, endpoint


class Tensors(Actor):
    @endpoint
    async def echo(self, t: torch.Tensor) -> torch.Tensor:
        return t

    @endpoint
    async def echo_many(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return ts

    @endpoint
    async def echo_array(self, a: np.ndarray) -> np.ndarray:
        return a

    @endpoint
    async def nbytes(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @endpoint
    async def checksum(self, t: torch.Tensor) -> float:
        return float(t.double().sum())

    @endpoint
    async def make(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32)


class CudaUser(Actor):
    """Sees only the devices the supervisor gave it."""

    @endpoint
    async def visible(self) -> tuple[int, str]:
        import os

        return torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")

    @endpoint
    async def on_device(self, t: torch.Tensor) -> torch.Tensor:
        return (t.cuda() * 2).contiguous()  # a CUDA result is copied to host by the codec
