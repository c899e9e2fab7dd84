"""The handles the driver holds, by the actor class behind them: each call through one is checked
against that actor's endpoint (``asyncrl/runtime/typing_plugin.py``). The classes are named for the
type checker only: the driver never imports an actor's module (nor torch) to run."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from asyncrl.runtime.handle import ActorHandle

if TYPE_CHECKING:
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.scorer.actor import ScorerActor
    from asyncrl.rl.trainer.actor import TrainerActor

SamplerHandle: TypeAlias = "ActorHandle[SamplerActor]"
ScorerHandle: TypeAlias = "ActorHandle[ScorerActor]"
TrainerHandle: TypeAlias = "ActorHandle[TrainerActor]"
Log: TypeAlias = Callable[[str], None]
"""Where a part of the driver says a line (the run's console, above its progress bar)."""
