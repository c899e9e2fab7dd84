"""Which accelerator devices this host has, and which of them are free.

Devices are found without importing torch (a supervisor must not initialise CUDA just to count):
the visibility variable if it is set, else the driver's device nodes. An actor that asks for
``gpus=n`` gets ``n`` free ids in its visibility variable, so inside it they are devices 0..n-1;
an actor that asks for none gets an empty list, so it cannot touch a device another actor owns.
"""

from __future__ import annotations

import glob
import os

from asyncrl.errors import NoFreeDevicesError

VISIBILITY_VARIABLE = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def detect(kind: str = "auto") -> tuple[str | None, list[str]]:
    """``(kind, device ids)`` of this host; ``(None, [])`` when it has none."""
    kinds = ["cuda", "npu"] if kind == "auto" else [kind]
    for k in kinds:
        if k not in VISIBILITY_VARIABLE:
            raise ValueError(f"device kind must be 'auto', 'cuda' or 'npu', not {k!r}")
        visible = os.environ.get(VISIBILITY_VARIABLE[k])
        if visible is not None:
            ids = [d.strip() for d in visible.split(",") if d.strip()]
        elif k == "cuda":
            ids = [str(i) for i in range(len(glob.glob("/proc/driver/nvidia/gpus/*")))]
        else:
            ids = [str(i) for i in range(len(glob.glob("/dev/davinci[0-9]*")))]
        if ids or kind != "auto":
            return k, ids
    return None, []


def offered(ids: list[str], nproc_per_node: int) -> list[str]:
    """The devices a node offers to placement: the first ``nproc_per_node`` (0: all)."""
    if nproc_per_node == 0:
        return list(ids)
    if nproc_per_node > len(ids):
        raise ValueError(f"nproc_per_node={nproc_per_node}, but this host has {len(ids)} device(s)")
    return list(ids[:nproc_per_node])


class DevicePool:
    def __init__(self, kind: str | None, ids: list[str], where: str = "this host"):
        self.kind = kind
        self.free = list(ids)
        self.total = len(ids)
        self.where = where

    def take(self, n: int, who: str) -> list[str]:
        if n < 0:
            raise ValueError(f"gpus must be >= 0, not {n}")
        if n > len(self.free):
            raise NoFreeDevicesError(
                f"actor {who!r} asks for {n} device(s); {len(self.free)} of {self.total} "
                f"{self.kind or 'accelerator'} device(s) on {self.where} are free"
            )
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give_back(self, ids: list[str]) -> None:
        self.free.extend(i for i in ids if i not in self.free)

    def env_for(self, ids: list[str]) -> dict[str, str]:
        if self.kind is None:
            return {}
        return {VISIBILITY_VARIABLE[self.kind]: ",".join(ids)}
