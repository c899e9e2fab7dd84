"""Test-only: a member announces the start of its transfer phase and stalls there, so that a fault
test can kill or freeze it while the buckets are on the wire, found by the member's own word rather
than by a guess at how long a sync takes (a tiny model's whole sync is a few milliseconds on a GPU).

``ASYNCRL_TEST_TRANSFER_HOOK=RANK:VERSION:STALL_S:PATH`` (`TRANSFER_HOOK_ENV`): the first member
of rank RANK to reach the transfer phase of sync VERSION (the first vote passed on every member, no
bucket moved yet: `weights._WeightSync._run`), in whichever generation of the group, claims PATH:
it creates it holding its pid, rank, version and the time (``time.time()``) as JSON, says so on
stderr, and stalls there for STALL_S seconds, as a member frozen mid-transfer would, before it goes
on. Its peers meanwhile wait in their own transfer. PATH is created exclusively, so one member
claims it once: the same version sent again to a re-formed group (the rank now another member's),
or to a restarted process that inherited the variable, runs as usual.

Unset, as in every real run, it costs one environment lookup per sync. Never set it in a real run.
"""

from __future__ import annotations

import json
import os
import sys
import time

TRANSFER_HOOK_ENV = "ASYNCRL_TEST_TRANSFER_HOOK"
"""Test-only (see the module docstring). Never set it in a real run."""


def at_transfer_start(rank: int, version: int) -> None:
    """Called by every member of a sync between its first vote and its first bucket."""
    spec = os.environ.get(TRANSFER_HOOK_ENV)
    if not spec:
        return
    want_rank, want_version, stall_s, path = spec.split(":", 3)
    if int(want_rank) != rank or int(want_version) != version:
        return
    claim = f"{path}.{os.getpid()}.tmp"
    with open(claim, "w") as f:
        json.dump({"pid": os.getpid(), "rank": rank, "version": version, "at": time.time()}, f)
    try:
        os.link(claim, path)  # whole, and exclusive: one member claims it, once
    except FileExistsError:
        return
    finally:
        os.unlink(claim)
    print(
        f"{TRANSFER_HOOK_ENV}: rank {rank} stalls {stall_s} s at the start of the transfer of v{version}",
        file=sys.stderr,
        flush=True,
    )
    time.sleep(float(stall_s))  # the injected fault itself: a member frozen mid-transfer
