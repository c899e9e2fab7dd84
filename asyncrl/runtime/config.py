"""Supervisor configuration: one frozen dataclass, defaults that work on a laptop, and the
``ASYNCRL_*`` environment variables through which ``asyncrl launch`` passes its flags."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "ASYNCRL_SUP_"


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    transport: str = "ipc"
    """'ipc' (Unix sockets in a private run directory) or 'tcp' (``host``, a free port per actor)."""
    host: str = "127.0.0.1"
    """Interface that actor sockets bind to when ``transport='tcp'``; never a wildcard by default."""
    call_timeout_s: float = 600.0
    """Default deadline of one call (per item for streams); override per handle or per call."""
    start_timeout_s: float = 120.0
    """Deadline for a new actor process to import its class and finish ``__init__``/``on_start``."""
    stop_timeout_s: float = 10.0
    """Graceful stop (``on_stop``) deadline before the process group gets SIGTERM."""
    term_timeout_s: float = 3.0
    """Deadline after SIGTERM before the process group gets SIGKILL."""
    heartbeat_interval_s: float = 0.5
    """How often each actor process reports that it is alive (from a thread of its own)."""
    heartbeat_timeout_s: float = 15.0
    """An actor silent this long (frozen, SIGSTOPped, swapped out) is killed and counted dead."""
    max_message_bytes: int = 1 << 31
    """Largest message (body plus tensor frames) a call or reply may be; larger ones are refused."""
    device_kind: str = "auto"
    """'auto', 'cuda' or 'npu': which visibility variable ``gpus=`` fills."""
    nnodes: int = 1
    """Nodes in the cluster. Above 1, this supervisor is node 0 and waits in ``start()`` for a node
    agent of every other rank to join (``asyncrl launch --node-rank R`` on each node)."""
    min_nnodes: int = 0
    """An elastic cluster (``asyncrl launch --nnodes MIN:MAX``, as torchrun's): ``start()`` waits for
    this many nodes (node 0 included); the others, up to ``nnodes``, may join while it runs and
    then take actors. 0: every one of ``nnodes`` is waited for."""
    drain_timeout_s: float = 120.0
    """In an elastic cluster, how long a node agent told to stop (SIGTERM, SIGINT) waits for its
    actors to be stopped by their owner before it stops them itself: the node is shown as
    ``draining`` meanwhile and takes no new actor (a GRPO run drains its samplers there, so
    nothing they accepted is lost). A second signal stops them at once; a fixed-size cluster's
    agent never waits."""
    master_addr: str = "127.0.0.1"
    """Address of node 0 as the other nodes reach it; with ``nnodes > 1`` the cluster socket binds
    here (never a wildcard)."""
    master_port: int = 29500
    """TCP port of the cluster socket on ``master_addr`` (torchrun's default)."""
    join_timeout_s: float = 300.0
    """Deadline for every node agent to join; the error names the missing nodes."""
    node_timeout_s: float = 5.0
    """A node agent silent this long is lost: its actors count as dead. An agent whose supervisor
    connection stays down this long stops its actors and exits."""
    nproc_per_node: int = 0
    """Accelerator devices this node offers to placement (the first N found); 0 means all."""
    zygote_preload: str = ""
    """Comma-separated modules for a zygote to import once, forking each local actor from it
    (runtime/zygotes/zygote.py), on a host with no accelerator; "": no zygote, every actor by ``Popen``.
    Worth it where actors import heavy modules (a GRPO run sets it); a zygote costs its imports'
    CPU at every supervisor start, wasted where actors need none of them."""
    handle_signals: bool = True
    """Turn SIGINT and SIGTERM into a clean shutdown while the supervisor is open (main thread
    only): the task that entered it is cancelled, every actor is stopped, then KeyboardInterrupt
    (SIGINT) or SystemExit(128 + signal) (SIGTERM) is raised."""

    def __post_init__(self) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', not {self.transport!r}")
        if self.device_kind not in ("auto", "cuda", "npu"):
            raise ValueError(f"device_kind must be 'auto', 'cuda' or 'npu', not {self.device_kind!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not value > 0:
                raise ValueError(f"{f.name} must be > 0, not {value!r}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed twice heartbeat_interval_s")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, not {self.nnodes}")
        if not 0 <= self.min_nnodes <= self.nnodes:
            raise ValueError(f"min_nnodes must be in 0..nnodes ({self.nnodes}), not {self.min_nnodes}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, not {self.master_port}")
        if self.nproc_per_node < 0:
            raise ValueError(f"nproc_per_node must be >= 0, not {self.nproc_per_node}")
        if self.node_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError("node_timeout_s must exceed twice heartbeat_interval_s")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, not {self.max_message_bytes}")

    @classmethod
    def from_env(cls, **overrides) -> SupervisorConfig:
        """Defaults, then ``ASYNCRL_SUP_<FIELD>`` variables (set by ``asyncrl launch``), then
        ``overrides``."""
        values: dict = {}
        for f in dataclasses.fields(cls):
            text = os.environ.get(ENV_PREFIX + f.name.upper())
            if text is None:
                continue
            kind: type[Any] = type(f.default)
            try:
                values[f.name] = (text.lower() in ("1", "true", "yes")) if kind is bool else kind(text)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX + f.name.upper()}={text!r} is not a valid {kind.__name__}") from None
        values.update(overrides)
        return cls(**values)
