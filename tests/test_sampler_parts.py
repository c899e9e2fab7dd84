"""The sampler actor's parts on their own, without an actor, a process or a model: `WeightReceiving`
(the seat, the gate, the syncs' counters) and `GatedGeneration` (generation behind that gate)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.sampler.backend import SamplerSyncStats, WeightSink
from asyncrl.rl.sampler.errors import SamplerError, SamplerTimeoutError
from asyncrl.rl.sampler.generation import GatedGeneration
from asyncrl.rl.sampler.weight_receiving import WeightReceiving
from asyncrl.runtime.timeouts import timeout

PARAMS = SamplingParams(max_new_tokens=2)


class ScriptedSink(WeightSink):
    """Receives by the script: each entry an exception to raise, or None to succeed."""

    def __init__(self, seat, script):
        self.seat, self.script, self.left = seat, list(script), 0

    async def join(self, address, rank):
        return "gloo"

    async def setup(self, timeout_s):
        raise SamplerError("setup_receiver before joining a weight-sync group")

    @property
    def ready(self):
        return True

    async def receive(self, version, *, in_flight, timeout_s):
        await asyncio.sleep(0)  # a real transfer yields: a generate in flight runs meanwhile
        outcome = self.script.pop(0)
        if outcome is not None:
            raise outcome
        return SamplerSyncStats(pause_s=0.5)

    async def leave(self):
        self.left += 1

    async def created(self):
        return {}

    async def digest(self):
        return ""


class HeldBackend:
    """Its first generate waits for ``release``; each returns one completion per prompt."""

    def __init__(self):
        self.started, self.release, self.calls = asyncio.Event(), asyncio.Event(), 0

    async def generate(self, prompts, n, params, progress=None):
        self.calls += 1
        if self.calls == 1:
            self.started.set()
            await self.release.wait()
        return [
            [Completion(token_ids=[7, 8], logprobs=[-0.1, -0.2], text="ab", finish_reason="length")] for _ in prompts
        ]


def parts(script, sync_timeout_s=30.0):
    backend = HeldBackend()
    made = {}

    def make_sink(seat):
        made["sink"] = ScriptedSink(seat, script)
        return made["sink"]

    weights = WeightReceiving(
        make_sink, name="s0", in_flight=False, sync_timeout_s=sync_timeout_s, generating=lambda: generation.calls
    )
    generation = GatedGeneration(backend, weights)
    return weights, generation, backend, made["sink"]


async def test_a_batch_in_flight_during_a_failed_sync_is_generated_again_after_the_next_one():
    weights, generation, backend, sink = parts([RuntimeError("a peer died mid-transfer"), None])
    rollout = asyncio.ensure_future(generation([[1, 2]], 1, PARAMS))
    async with timeout(10):
        await backend.started.wait()
    with pytest.raises(RuntimeError, match="a peer died"):
        await weights.receive(1)
    assert weights.failures == 1 and weights.version == 0
    assert weights.counts["failed_syncs"] == 1 and weights.counts["syncs_waited_for_generate"] == 1
    backend.release.set()  # the batch that may have read half-written weights ends: it is discarded
    stats = await weights.receive(2)  # meanwhile the retry waits behind the shut gate
    assert stats.pause_s == 0.5 and stats.seconds > 0
    async with timeout(10):
        version, groups, _ = await rollout
    assert version == 2 and backend.calls == 2 and len(groups) == 1  # generated again under v2, not v0
    assert generation.counts["discarded_batches"] == 1 and generation.counts["batches"] == 2
    assert generation.counts["completions"] == 1 and generation.counts["tokens"] == 2 and generation.calls == 0
    assert weights.counts["syncs"] == 1 and weights.counts["failed_syncs"] == 1


async def test_a_pause_that_outlasts_the_sync_names_what_long_completions_need():
    """Pause mode waits for the batch in flight, which long completions can make longer than the
    sync's deadline: the error names both ways out, and the weights, untouched, still serve."""
    weights, _, _, _ = parts([SamplerTimeoutError("the batch in flight did not end")], sync_timeout_s=1.0)
    names = "within 1 s .*--sampler.weight_update in_flight.*--run.sync_timeout_s"
    with pytest.raises(SamplerTimeoutError, match=names):
        await weights.receive(1)
    assert weights.failures == 0 and weights.counts["failed_syncs"] == 1


async def test_the_sink_joins_through_the_parts_seat_and_leaving_releases_both():
    weights, _, _, sink = parts([])
    assert sink.seat is weights.seat  # the seat is handed to the sink: no call back into the actor
    port = weights.listen("127.0.0.1")
    await weights.leave()
    await weights.leave()  # idempotent
    assert sink.left == 2
    with socket.create_server(("127.0.0.1", port)):  # the reserved listener was closed
        pass
    with pytest.raises(SamplerError, match="^sampler s0: setup_receiver before joining"):
        await weights.setup(5.0)


def test_auto_picks_hf_on_the_cpu_even_with_vllm_installed_and_vllm_stays_there_when_asked():
    import torch

    from asyncrl.rl.sampler.factory import choose_backend

    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu) == "hf"  # without importing vLLM (CI has its CPU build)
    assert choose_backend("hf", torch.device("cuda")) == "hf"
    with pytest.raises(ValueError, match="sampler backend must be one of"):
        choose_backend("vllm-cpu", cpu)
