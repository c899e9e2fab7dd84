"""Checks made while a run starts, each as soon as what it needs is known: the device plan, the
cluster, the started samplers. `preflight.check_run` checked what the config and the file system
decide; these refuse, in one `ConfigError` line naming the flag and the fix, what only the hosts
can tell, before the steps begin:

* ``--run.placement`` against the cluster's nodes and the device plan (`check_placement`, which
  also answers where each actor goes);
* ``--run.check_weights`` against the samplers' backends: vLLM on the CPU (asked for: auto is hf
  there) repacks the weights, so
  their digests cannot match the trainer's (`check_backend_readable` before anything is spawned,
  `check_digestible` once the samplers run, as those on other nodes may have chosen otherwise).
"""

from __future__ import annotations

import asyncio

from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.run import Placement
from asyncrl.rl.driver.devices import DevicePlan
from asyncrl.rl.driver.fleet.calls import call_all
from asyncrl.rl.driver.fleet.handles import SamplerHandle


def check_placement(
    text: str, ranks: int, samplers: int, nnodes: int, plan: DevicePlan
) -> tuple[list[int | None], list[int | None]]:
    """The node of each trainer rank and each sampler (None: the supervisor's default), from
    ``--run.placement``; a `ConfigError` for a node the cluster lacks, or for colocated samplers
    (they share trainer rank 0's GPU) placed on another node than it."""
    placement = Placement.parse(text)
    try:
        trainer, sampler = placement.nodes("trainer", ranks, nnodes), placement.nodes("sampler", samplers, nnodes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if plan.colocated and any(n is not None and n != trainer[0] for n in sampler):
        raise ConfigError(
            f"--run.placement {text!r} puts samplers on another node than trainer rank 0, but they "
            f"share its GPU ({plan.line}); place them with it, or give the run a GPU per actor"
        )
    return trainer, sampler


async def check_backend_readable(backend: str, device: str) -> None:
    """``--run.check_weights`` with a backend that would hold its weights in another form than
    the sent tensors on the device the plan gave the run (vLLM on the CPU): refused before anything
    is spawned. The backend's class says so (no name is compared here); knowing it imports vLLM
    (seconds), in a thread. `check_digestible` still asks the started samplers, since those on
    other nodes may pick otherwise."""
    import torch

    from asyncrl.rl.sampler.factory import backend_class

    where = torch.device(device)
    if where.type == "cpu" and not (await asyncio.to_thread(backend_class, backend, where)).digestible_on(where):
        raise ConfigError(
            f"--run.check_weights needs samplers whose weights can be read as sent, but --sampler.backend "
            f"{backend} picks vLLM here ({device}), which repacks them on the CPU; add --sampler.backend hf, "
            "or drop check_weights"
        )


async def check_digestible(samplers: list[SamplerHandle]) -> None:
    """``--run.check_weights`` digests each sampler's weights where they are held; vLLM on the CPU
    repacks them for its kernels, so refuse it before the run (a sampler on another node than the
    driver's may have picked vLLM, or the CPU, where this one did not)."""
    answers = await call_all(samplers, lambda h, _: h.stats(), timeout_s=None, what="the check of its backend")
    for stats in answers.results:  # a sampler that cannot answer this cannot take part in the run: as it is
        if isinstance(stats, BaseException):
            raise stats
        if not stats.digestible:
            raise ConfigError(
                f"--run.check_weights needs samplers whose weights can be read as sent, but {stats.name} "
                f"runs {stats.backend} on {stats.device}, which repacks them; add --sampler.backend hf, or "
                "drop check_weights"
            )
