"""`SyncAddress`: where a weight-sync group meets, and the one place its values are checked.

Every member of one membership is given the same address (the driver's `form_group`, or the
fleet's `SyncGroup`) and its own rank beside it: ``join(address, rank)`` wherever a member joins,
in an actor (its `SyncSeat.join`), through a sampler's sink, or in vLLM's engine process, which
receives it as plain values (``msgspec.to_builtins``) and checks it again with ``msgspec.convert``.

This module imports no torch: the rendezvous (`rendezvous.py`) and the backend factory (`join.py`)
take their checks from here.
"""

from __future__ import annotations

import msgspec

BACKENDS = ("auto", "nccl", "hccl", "gloo", "ipc")
"""``ipc``: CUDA IPC between processes on one GPU (`cuda_ipc.py`); never what ``auto`` picks."""


class SyncAddress(msgspec.Struct, frozen=True, kw_only=True):
    """The group ``name``/``generation`` whose store rank 0 hosts at ``host:port``, with
    ``world_size`` members, each making a ``backend`` communicator, every wait of the join within
    ``timeout_s``. Shared by all members; each joins with its own rank (`check_rank`). Checked
    when built and when decoded, so a bad value is refused where it arrives, by name."""

    host: str
    """The address rank 0's store listens on, reachable by every member (across hosts: the
    node's ``ASYNCRL_NODE_ADDR``)."""
    port: int
    """The store's port; 0 only for rank 0, which then picks a free one."""
    world_size: int
    """How many members the group has, rank 0 (the sender) included."""
    generation: int = 0
    """The membership: a group rebuilt after a member was lost meets under the next one, so it
    never reads a key an earlier membership left."""
    backend: str = "auto"
    """The communicator every member makes (`join.make_communicator`; one of `BACKENDS`)."""
    timeout_s: float = 60.0
    """One deadline for the rendezvous and the communicator together."""
    name: str = "weights"
    """The group's name: its store keys live under ``asyncrl/<name>/g<generation>/``."""

    def __post_init__(self) -> None:
        check_str("host", self.host)
        for what, value in (("port", self.port), ("world_size", self.world_size), ("generation", self.generation)):
            check_count(what, value)
        if not self.port < 65536:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, not {self.world_size}")
        check_backend(self.backend)
        check_timeout(self.timeout_s)
        check_name(self.name)

    @property
    def label(self) -> str:
        """``name/g<generation>``, as the group and its communicator are named."""
        return f"{self.name}/g{self.generation}"

    def check_rank(self, rank: object) -> None:
        """Refuse a ``rank`` that is not a member's of this group, or that is told port 0 (only
        rank 0 may pick the store's port; the others must be told it)."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"rank must be an int, not {rank!r}")
        check_rank(rank, self.world_size)
        if self.port == 0 and rank != 0:
            raise ValueError(f"rank {rank} cannot join a store at port 0: only rank 0 picks the port")


def check_count(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, not {value!r}")


def check_str(what: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")


def check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")


def check_timeout(timeout_s: object) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number, not {timeout_s!r}")


def check_name(name: object) -> None:
    if not isinstance(name, str) or "/" in name or not name:
        raise ValueError(f"group name must be non-empty and contain no '/': {name!r}")


def check_backend(backend: object) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown communicator backend {backend!r} ({', '.join(BACKENDS)})")
