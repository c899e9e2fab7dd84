"""Two sampler actors on one vLLM engine (``--sampler.clients_per_engine 2``), for real: sampler0
starts the engine core and is its first client, sampler1 attaches to it from its own process. A
weight update goes through the host alone and reaches the one copy of the weights (both clients'
greedy tokens change, and come back with the original weights), each client's requests finish
across a sync (pause mode: the host pauses the whole engine), a client killed mid-run comes back on
a slot of its own and samples the current weights, and the host's death ends the client's engine
at once (its generates fail, naming the host) with no engine process left behind. The driver's
side (only the host a rank, a lost host losing its clients) is in test_recovery_pool.py.

Where vLLM is not installed these tests skip, unless ``ASYNCRL_REQUIRE_VLLM=1`` (see vllm_support).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal

import msgspec
import pytest
import pytest_asyncio

from asyncrl import ActorDiedError, ActorState, RemoteError, Supervisor
from asyncrl.comm.member import form_group
from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.generation import SamplingParams, VersionSpan
from asyncrl.rl.sampler.actor import SamplerActor
from asyncrl.rl.sampler.errors import SamplerError
from asyncrl.rl.sampler.vllm.request_versions import RequestVersions
from asyncrl.rl.sampler.vllm.shared import EngineShare, EngineWatch
from conftest import descendants, process_alive
from sampler_support import HOST, N_HELDOUT, N_TRAIN, until_generating
from vllm_support import SYNC_BACKEND, VLLM_ENV, StatePusher, engine_options, state_files

pytest_plugins = ["sampler_support", "vllm_support"]  # fixtures: tiny_path, policy; vllm_required

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("actor_zygote")]  # tests/conftest.py: forked actors

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


# --- the parts, without vLLM ----------------------------------------------------------------------


def test_each_client_incarnation_has_a_slot_of_its_own():
    """Two clients of two incarnations each: four slots, client k's incarnation i at 2k + i - 1,
    every address distinct and named by the engine's token; an incarnation the engine was not
    started for is refused, naming the knob; a token that is not hex is refused."""
    shares = [EngineShare(token="0123abcd", host="sampler4", client=k, clients=2, incarnations=2) for k in (0, 1)]
    assert [s.slot(i) for s in shares for i in (1, 2)] == [0, 1, 2, 3]
    inputs, outputs = shares[1].addresses()
    assert inputs == shares[0].addresses()[0] and len(set(inputs + outputs)) == 8
    assert inputs[3] == "ipc://@asyncrl-engine-0123abcd-3-in"  # abstract namespace: no file to leave behind
    with pytest.raises(SamplerError, match=r"incarnation 3 of client 1 of sampler4's engine has no place"):
        shares[1].slot(3)
    with pytest.raises(ValueError, match="hex digits"):
        EngineShare(token="../x", host="sampler0", client=0, clients=2, incarnations=1)


def test_a_load_splits_the_requests_it_lists_and_never_hides_the_others_lag():
    """At a load to v1: a request the engine lists switches at its position; one it does not list
    begins on v1 if it was sent after the load was asked for (number >= since), and otherwise keeps
    v0 for every token (it may have run, and ended, before the load: over-counted, not hidden); a
    request whose sample 1 is listed (vLLM's "1_" prefix) splits that sample alone."""
    versions = RequestVersions()
    listed = versions.begin("asyncrl-0123abcd-0", 0, 1, 0)
    unlisted_before = versions.begin("asyncrl-0123abcd-1", 1, 1, 0)
    two = versions.begin("asyncrl-0123abcd-2", 2, 2, 0)
    unlisted_after = versions.begin("asyncrl-0123abcd-3", 3, 1, 0)
    table = {"asyncrl-0123abcd-0-5eed": 7, "1_asyncrl-0123abcd-2-5eed": 4, "asyncrl-ffffffff-3": 3}
    versions.changed(1, table, since=3)
    assert listed == [[VersionSpan(0, 0), VersionSpan(7, 1)]]
    assert unlisted_before == [[VersionSpan(0, 0)]]
    assert unlisted_after == [[VersionSpan(0, 1)]]
    assert two == [[VersionSpan(0, 0)], [VersionSpan(0, 0), VersionSpan(4, 1)]]
    versions.end("asyncrl-0123abcd-0")
    versions.changed(2, None, since=4)  # the engine could not tell: nothing moves, even what began after
    assert unlisted_after == [[VersionSpan(0, 1)]] and listed == [[VersionSpan(0, 0), VersionSpan(7, 1)]]


async def test_the_engine_watch_calls_back_once_the_process_has_ended():
    """A client's watch on the engine's process waits on a pidfd: told when the process ends,
    once; a process already gone cannot be watched (a `SamplerError`, not a silent client)."""
    proc = await asyncio.create_subprocess_exec("sleep", "30")
    ended = asyncio.get_running_loop().create_future()
    watch = EngineWatch(proc.pid, ended.set_result)
    proc.kill()
    assert await asyncio.wait_for(ended, 10.0) == proc.pid
    await proc.wait()
    watch.close()
    with pytest.raises(SamplerError, match=f"cannot watch the engine's process {proc.pid}"):
        EngineWatch(proc.pid, ended.set_result)


# --- two samplers on one engine -------------------------------------------------------------------


def _spawn(sup, tiny_path, device, share: EngineShare):
    config = SamplerConfig(
        group_size=3, prompts_per_batch=2, weight_update="pause", backend="vllm", clients_per_engine=share.clients
    )
    on_gpu = device.type == "cuda"
    return sup.spawn(
        SamplerActor,
        tiny_path,
        config,
        name=f"sampler{share.client}",
        env=VLLM_ENV,
        gpus=int(on_gpu and share.is_host),
        share_devices_with=share.host if on_gpu and not share.is_host else None,
        max_restarts=0 if share.is_host else share.incarnations - 1,  # a restarted host: a new engine
        kwargs=dict(
            data=DataConfig(n_train=N_TRAIN, n_heldout=N_HELDOUT),
            seed=share.client,
            device=device.type,
            vllm={"engine": engine_options(device)},
            sync_timeout_s=60.0,
            engine_share=share,
        ),
    )


class Engine(msgspec.Struct):
    """The module's shared engine: its supervisor, host, client and the weights' sender, in a group
    of the sender and the host; what greedy decoding gave before any sync."""

    sup: Supervisor
    host: object
    client: object
    pusher: object
    probe: list
    before: list


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(vllm_required, tiny_path, policy, tmp_path_factory):
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout

    train, _ = train_and_heldout(0, N_TRAIN, N_HELDOUT)
    probe = [policy[2].render_ids(Countdown().prompt(p)) for p in train[:2]]
    files = state_files(policy[0], str(tmp_path_factory.mktemp("weights")))
    token = secrets.token_hex(8)
    shares = [EngineShare(token=token, host="sampler0", client=k, clients=2, incarnations=2) for k in (0, 1)]
    async with Supervisor(call_timeout_s=120, start_timeout_s=240) as sup:
        # Together: the client binds its slot and waits for the engine the host is starting.
        pusher, host, client = await asyncio.gather(
            sup.spawn(StatePusher, files, name="pusher", env={"OMP_NUM_THREADS": "1"}),
            _spawn(sup, tiny_path, vllm_required, shares[0]),
            _spawn(sup, tiny_path, vllm_required, shares[1]),
        )
        assert await form_group([pusher, host], HOST, backend=SYNC_BACKEND, timeout_s=60) > 0
        await asyncio.gather(pusher.setup(), host.setup_receiver(60))
        before = await host.generate(probe, 1, GREEDY)
        yield Engine(sup, host, client, pusher, probe, before)


async def _in_the_engine(client, call: asyncio.Future, probe) -> None:
    """Once this returns, the requests of ``call`` (a generate of ``client``'s, just begun) are in
    the engine: a short generate sent after them has come back, and the client sends its requests,
    and the engine takes them, in order."""
    await until_generating(client, call)
    await client.generate(probe[:1], 1, msgspec.structs.replace(GREEDY, max_new_tokens=1))
    assert not call.done(), "the generate ended before the engine was seen to hold it"


def _tokens(groups) -> list[list[int]]:
    return [g[0].token_ids for g in groups]


@pytest.mark.asyncio(loop_scope="module")
async def test_a_weight_update_through_the_host_reaches_every_client_and_their_requests_finish(engine):
    """The client samples what the host does (one engine); during a generate of the client's, the
    host's sync in pause mode waits for it (the whole engine paused), so it ends on the old
    weights, all its tokens tagged with the old version; after the sync both clients sample the
    new weights, which the client never received itself; the original weights restore both."""
    host, client, pusher, probe, before = engine.host, engine.client, engine.pusher, engine.probe, engine.before
    assert _tokens(await client.generate(probe, 1, GREEDY)) == _tokens(before)
    long = msgspec.structs.replace(GREEDY, max_new_tokens=400)
    old_long = _tokens(await client.generate(probe, 1, long))
    inflight = asyncio.ensure_future(client.generate(probe * 8, 2, long))
    await _in_the_engine(client, inflight, probe)
    await asyncio.gather(pusher.send(1, "changed"), host.receive_weights(1))
    for group, old in zip(await inflight, old_long * 8):
        assert [c.token_ids for c in group] == [old, old]  # every token of the old weights: the load waited
        assert all(c.version_spans == [] for c in group)  # and said so: no change of version under it
    told = await client.receive_weights(1)
    assert told.receive is None  # nothing came to the client: it read the engine's version
    changed = _tokens(await host.generate(probe, 1, GREEDY))
    assert changed != _tokens(before) and _tokens(await client.generate(probe, 1, GREEDY)) == changed
    [group] = [g async for g in client.rollouts(1)]
    assert group.version == 1

    await asyncio.gather(pusher.send(2, "original"), host.receive_weights(2))
    await client.receive_weights(2)
    assert _tokens(await client.generate(probe, 1, GREEDY)) == _tokens(before)
    assert (await client.stats()).version == 2 and await client.sync_created() == {"gloo": 1}  # the host's


@pytest.mark.asyncio(loop_scope="module")
async def test_a_client_killed_mid_run_comes_back_and_the_host_s_death_ends_it(engine):
    """SIGKILL of the client while it generates: the host goes on generating and taking weights;
    the client's restart attaches to the same engine (a slot kept for its second incarnation) and,
    told of the version, samples the current weights. Then SIGKILL of the host: its engine core
    goes with it (the host's process group), and the client learns it from the engine's process,
    not from a timeout: its next generate fails at once, naming the host, which makes the driver
    lose it as any sampler whose stream failed. (One test: the restarted client, a process this
    test started, must be stopped by it.)"""
    sup, host, client, pusher, probe = engine.sup, engine.host, engine.client, engine.pusher, engine.probe
    try:
        long = msgspec.structs.replace(GREEDY, max_new_tokens=400)
        inflight = asyncio.ensure_future(client.generate(probe * 8, 2, long))
        await _in_the_engine(client, inflight, probe)
        os.kill(sup._records["sampler1"].proc.pid, signal.SIGKILL)
        [died] = await asyncio.gather(inflight, return_exceptions=True)
        assert isinstance(died, ActorDiedError), died
        await asyncio.gather(pusher.send(3, "changed"), host.receive_weights(3))
        changed = _tokens(await host.generate(probe, 1, GREEDY))
        info = await client.wait_for_incarnation(1, 120)
        assert info.incarnation == 2 and info.state is ActorState.RUNNING, info
        await client.receive_weights(3)
        assert _tokens(await client.generate(probe, 1, GREEDY)) == changed

        host_pid = sup._records["sampler0"].proc.pid
        engine_pids = descendants(host_pid)
        assert engine_pids, "vLLM's engine core should run below its host"
        os.kill(host_pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while any(process_alive(p) for p in engine_pids):
            assert loop.time() < deadline, "vLLM's engine outlived its host"
            await asyncio.sleep(0.05)
        with pytest.raises(RemoteError, match="sampler0's vLLM engine ended"):
            await asyncio.wait_for(client.generate(probe, 1, GREEDY), 30.0)
    finally:
        await sup.stop(client)
