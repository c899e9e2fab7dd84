"""Where a new actor goes and how its process finds its class: checked before anything starts.

``place`` picks the node and takes the devices (first fit: a multi-device actor keeps its devices
on one node); ``class_ref`` names the class so a fresh interpreter can import it; ``check_name``
keeps actor names usable in file names and logs.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

from asyncrl.errors import ActorStartError, NoFreeDevicesError
from asyncrl.runtime import worker as worker_env
from asyncrl.runtime.devices import DevicePool

if TYPE_CHECKING:
    from asyncrl.runtime.cluster.nodes import Cluster

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"actor name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    return name


def class_ref(cls: type) -> tuple[str, str, str]:
    """``(module, qualname, script path)`` by which a worker imports ``cls``; the path is set only
    for a class of the script being run (``__main__``), which the worker loads from that file."""
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"actor class {cls.__qualname__} must be defined at module level to be importable")
    module = cls.__module__
    if module in ("__main__", worker_env.SCRIPT_MODULE):
        path = getattr(sys.modules.get(module), "__file__", None)
        if not path:
            raise TypeError(f"actor class {cls.__qualname__} is defined interactively; put it in a file")
        return worker_env.SCRIPT_MODULE, cls.__qualname__, os.path.abspath(path)
    return module, cls.__qualname__, ""


def place(
    name: str, gpus: int, node: int | None, nnodes: int, local: DevicePool, cluster: Cluster | None
) -> tuple[int, list[str]]:
    """``(node rank, device ids)`` for actor ``name``, the devices taken from that node's pool.
    ``node`` None: node 0 for an actor without devices, else the lowest-ranked live node with
    ``gpus`` free. Raises ``NoFreeDevicesError`` when no node can meet ``gpus``,
    ``ActorStartError`` when the node asked for is lost."""
    if not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be an int >= 0, not {gpus!r}")
    pools = {0: local, **{r: nd.pool for r, nd in (cluster.open() if cluster else {}).items()}}
    if node is not None:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nnodes:
            raise ValueError(f"node must be an int in 0..{nnodes - 1}, not {node!r}")
        if node not in pools:  # lost, or (an elastic cluster) not joined yet
            known = cluster.nodes.get(node) if cluster is not None else None
            why = (
                "has not joined the cluster"
                if known is None
                else f"is lost ({known.lost})"
                if known.lost
                else f"is leaving ({known.draining})"
            )
            raise ActorStartError(name, f"node {node} {why}")
        return node, pools[node].take(gpus, name)
    if gpus == 0:
        return 0, []
    for rank in sorted(pools):
        if len(pools[rank].free) >= gpus:
            return rank, pools[rank].take(gpus, name)
    if len(pools) == 1:
        return 0, local.take(gpus, name)  # raises, with the single-host wording
    free = ", ".join(f"node {r}: {len(p.free)} of {p.total}" for r, p in sorted(pools.items()))
    raise NoFreeDevicesError(f"actor {name!r} asks for {gpus} device(s); no node has that many free ({free})")
