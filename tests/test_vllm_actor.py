"""The sampler actor on the vLLM backend, for real, in actor processes: its weight syncs received by
vLLM's worker process (changed, restored exactly, a failed one, a sender killed mid-sync),
vLLM's processes ending with the actor (SIGKILL of the actor, SIGKILL of the supervisor), and a
GRPO smoke run with ``--sampler.backend vllm``. On vLLM's CUDA build the sampler runs on the first
GPU; the whole-run tests need a second GPU for the trainer (until samplers can share its GPU).

Where vLLM is not installed these tests skip, unless ``ASYNCRL_REQUIRE_VLLM=1`` (see vllm_support).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import pytest_asyncio

from asyncrl import RemoteError, Supervisor
from asyncrl.comm.member import form_group
from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.driver.fleet.sync_group import suffered_from_peer
from asyncrl.rl.generation import SamplingParams
from asyncrl.rl.sampler.actor import SamplerActor
from conftest import descendants, kill_all, orphaned_shm, process_alive, shm_names, wait_until
from sampler_support import HOST, N_HELDOUT, N_TRAIN, until_generating
from vllm_support import (
    MULTIPROCESS_EXECUTOR,
    SYNC_BACKEND,
    VLLM_ENV,
    StatePusher,
    engine_options,
    needs_two_devices,
    repeat_abs,
    state_files,
)

pytest_plugins = ["sampler_support", "vllm_support"]  # fixtures: tiny_path, policy; vllm_required

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("actor_zygote")]  # tests/conftest.py: forked actors


# --- the sampler actor: weights received by vLLM's worker process ---------------------------------


def _spawn_sampler(sup, tiny_path, device, **sampler):
    """A vLLM sampler on ``device`` taking weights after the batch in flight (``weight_update="pause"``)."""
    config = SamplerConfig(group_size=3, prompts_per_batch=2, weight_update="pause", backend="vllm", **sampler)
    return sup.spawn(
        SamplerActor,
        tiny_path,
        config,
        name="smp",
        env=VLLM_ENV,
        gpus=int(device.type == "cuda"),
        kwargs=dict(
            data=DataConfig(n_train=N_TRAIN, n_heldout=N_HELDOUT),
            seed=1,
            device=device.type,
            vllm={"engine": engine_options(device)},
            sync_timeout_s=60.0,
        ),
    )


class SharedSampler(msgspec.Struct):
    """The module's vLLM sampler: its supervisor, its handle, and what its first generate (greedy,
    on the probe prompts) gave and took."""

    sup: Supervisor
    sampler: object
    shm_before: set
    first: list
    first_generate_s: float


def _probe(policy) -> list[list[int]]:
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout

    train, _ = train_and_heldout(0, N_TRAIN, N_HELDOUT)
    return [policy[2].render_ids(Countdown().prompt(p)) for p in train[:2]]


GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_sampler(vllm_required, tiny_path, policy):
    """One vLLM sampler for the tests below that need a fresh one (an engine start with its
    sampling-op compile is 30-45 s of the 2-core machine). The held-out evaluation uses it first;
    the weight-sync test last, as it ends by SIGKILLing it (a test after that fails on a dead actor,
    never passes by accident). Its first generate is timed here, where it is the first."""
    shm_before = shm_names()
    async with Supervisor(call_timeout_s=120, start_timeout_s=240) as sup:
        sampler = await _spawn_sampler(sup, tiny_path, vllm_required, max_new_tokens=24, temperature=1.0)
        start = time.perf_counter()
        first = await sampler.generate(_probe(policy), 1, GREEDY)
        yield SharedSampler(sup, sampler, shm_before, first, time.perf_counter() - start)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_vllm_sampler_evaluates_held_out_problems_beside_its_rollouts(shared_sampler):
    """``--run.eval_on samplers`` on vLLM: the sampler solves every held-out problem (greedy, and
    sampled twice each) with its parts in flight at once, while a rollout stream runs on the same
    engine; every part of version 0 (the driver would not count one of another), nothing left for
    the trainer. Greedy is deterministic on an engine: a second evaluation, alongside nothing, finds
    the same greedy rate and metric sums. (Not compared with the trainer's: vLLM's kernels are not
    transformers', and near-ties may go the other way; tests/test_heldout_samplers.py has that
    comparison on the HF backend.)"""
    from asyncrl.rl.config.run import RecoveryConfig, RunConfig
    from asyncrl.rl.driver import heldout
    from asyncrl.rl.driver.fleet.membership import Membership, MemberState

    class NotAsked:
        name = "trainer"

        def with_timeout(self, timeout_s):
            return self

        async def evaluate_heldout(self, *args, **kwargs):
            raise AssertionError(f"the trainer was asked {args}")

    run = RunConfig(eval_samples=2, eval_on="samplers", data=DataConfig(n_train=N_TRAIN, n_heldout=N_HELDOUT))
    logs: list[str] = []
    sampler = shared_sampler.sampler
    members = Membership([sampler], [0], recovery=RecoveryConfig(), log=print)
    members.members[0].state, members.members[0].incarnation = MemberState.JOINED, sampler.info().incarnation
    rollouts = asyncio.ensure_future(_collect(sampler.rollouts(4)))
    first = await heldout.evaluate(NotAsked(), run, logs.append, version=0, members=members)
    groups = await asyncio.wait_for(rollouts, 120)
    again = await heldout.evaluate(NotAsked(), run, logs.append, version=0, members=members)
    stats = await sampler.stats()
    assert members.members[0].in_group and len(groups) == 4 and stats.groups == 4, stats
    assert 0.0 <= first.rates["greedy"] <= 1.0 and 0.0 <= first.rates["sampled"] <= 1.0
    greedy = {k: v for k, v in first.extra.items() if k.startswith("heldout/task/")}
    assert greedy and (again.rates["greedy"], {k: again.extra[k] for k in greedy}) == (first.rates["greedy"], greedy)
    assert logs[-1].startswith(f"held-out evaluation of v0: {N_HELDOUT} problems greedy and {N_HELDOUT} x 2 sampled")
    assert logs[-1].endswith(" on smp")


@pytest.mark.asyncio(loop_scope="module")
async def test_weights_update_over_gloo_into_the_vllm_worker(shared_sampler, vllm_required, policy, tmp_path):
    """Pause mode: new weights change the greedy output; the original ones restore it exactly;
    a sync during a generate waits for it; a failed sync fails on both sides and holds rollouts
    until a good one; the sender's death mid-sync is a peer's failure, and the engine rejoins a
    rebuilt group. Then SIGKILL the actor: vLLM's engine process must go with it."""
    # vLLM's sampling ops were compiled while the sampler started (`SamplerActor.on_start`), so
    # its first generate (the fixture's) is as quick as any: compiled at first use (6 s and more
    # here), they held up the first weight sync a sampler added by a scale-up joined.
    took = shared_sampler.first_generate_s
    print(f"the first generate of a started vLLM sampler: {took:.2f} s")
    assert took < 3.0, f"the first generate of a started vLLM sampler took {took:.1f} s"

    model, _, _ = policy
    files = state_files(model, str(tmp_path))
    probe, greedy = _probe(policy), GREEDY
    sup, sampler, shm_before = shared_sampler.sup, shared_sampler.sampler, shared_sampler.shm_before
    pusher = await sup.spawn(StatePusher, files, name="pusher", env={"OMP_NUM_THREADS": "1"})
    try:
        assert await form_group([pusher, sampler], HOST, backend=SYNC_BACKEND, timeout_s=60) > 0
        buckets, _ = await asyncio.gather(pusher.setup(), sampler.setup_receiver(60))
        assert buckets > 1  # a 64 KiB bucket: the tiny model takes several
        before = await sampler.generate(probe, 1, greedy)
        assert [g[0].token_ids for g in before] == [g[0].token_ids for g in shared_sampler.first]

        groups = [g async for g in sampler.rollouts(2)]
        assert [g.version for g in groups] == [0, 0] and all(len(g.completion_ids) == 3 for g in groups)

        # Long enough for the sync's call to surely arrive during it, by its width: the model's 128
        # positions cut its length to a few dozen tokens whatever max_new_tokens asks. With 64
        # completions, once under load (CI, 2026-11-29) no poll of the sampler's stats saw it in flight.
        decoded = (await sampler.stats()).decoded
        inflight = asyncio.ensure_future(
            sampler.generate(probe * 32, 8, msgspec.structs.replace(greedy, max_new_tokens=400))
        )
        await until_generating(sampler, inflight)
        # Its tokens are counted as the engine decodes them, not when the call returns: the
        # driver's sign that a long group is not a stuck sampler (driver/fleet/decoding.py).
        while not ((now := await sampler.stats()).generating and now.decoded > decoded):
            assert not inflight.done(), "no answer to stats saw the generate's tokens while it ran"
            await asyncio.sleep(0.005)
        _, synced = await asyncio.gather(pusher.send(1, "changed"), sampler.receive_weights(1))
        assert inflight.done() and synced.pause_s > 0  # pause mode: the sync waited for the generate in flight
        assert 0 < synced.receive.copy_s <= synced.receive.seconds <= synced.seconds  # the worker's load, in it
        assert all(c.token_ids[:16] == before[0][0].token_ids for c in inflight.result()[0])
        changed = await sampler.generate(probe, 1, greedy)
        assert [g[0].token_ids for g in changed] != [g[0].token_ids for g in before]

        await asyncio.gather(pusher.send(2, "original"), sampler.receive_weights(2))
        restored = await sampler.generate(probe, 1, greedy)
        assert [g[0].token_ids for g in restored] == [g[0].token_ids for g in before]
        assert [lp for g in restored for lp in g[0].logprobs] == pytest.approx(
            [lp for g in before for lp in g[0].logprobs],
            abs=1e-5 if vllm_required.type == "cpu" else repeat_abs(vllm_required),
        )
        [late] = [g async for g in sampler.rollouts(1)]
        assert late.version == 2

        failed = await asyncio.gather(pusher.send(3, "changed"), sampler.receive_weights(4), return_exceptions=True)
        assert all(isinstance(r, RemoteError) for r in failed), failed
        assert failed[1].remote_type == "WeightSyncError", failed[1]  # the worker's error type came through
        waiting = asyncio.ensure_future(_collect(sampler.rollouts(1)))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # no rollout from weights that may be half-written
        await asyncio.gather(pusher.send(5, "changed"), sampler.receive_weights(5))
        [late] = await asyncio.wait_for(waiting, 60)
        assert late.version == 5
        stats = await sampler.stats()
        assert stats.syncs == 3 and stats.failed_syncs == 1 and stats.syncs_waited_for_generate >= 1
        assert await sampler.sync_created() == {"gloo": 1}  # one communicator, in the engine's process

        # The sender dies in the middle of a sync: the engine's failure says it suffered a peer's
        # (so the driver keeps this sampler), and the engine joins the rebuilt group and takes weights.
        receiving = asyncio.ensure_future(sampler.receive_weights(6))
        await asyncio.sleep(1.0)
        os.kill(sup._records["pusher"].proc.pid, signal.SIGKILL)
        [suffered] = await asyncio.gather(receiving, return_exceptions=True)
        assert isinstance(suffered, RemoteError) and suffered_from_peer(suffered), suffered
        pusher = await sup.spawn(StatePusher, files, name="pusher2", env={"OMP_NUM_THREADS": "1"})
        assert await form_group([pusher, sampler], HOST, generation=1, backend=SYNC_BACKEND, timeout_s=60) > 0
        await asyncio.gather(pusher.setup(), sampler.setup_receiver(60))
        await asyncio.gather(pusher.send(7, "original"), sampler.receive_weights(7))
        assert [g[0].token_ids for g in await sampler.generate(probe, 1, greedy)] == [g[0].token_ids for g in before]
        assert await sampler.sync_created() == {"gloo": 2}

        # SIGKILL of the actor: its group (vLLM's engine core, its worker, multiprocessing's
        # resource tracker) goes with it.
        actor_pid = sup._records["smp"].proc.pid
        engine_pids = descendants(actor_pid)
        assert len(engine_pids) >= 2, "vLLM's engine core and worker should run below the actor"
        os.kill(actor_pid, signal.SIGKILL)
        assert await _all_gone(engine_pids, 10.0), "vLLM's engine outlived its actor"
        # ... and what vLLM leaves behind when killed: its shared memory, its socket files.
        assert await _until(lambda: not orphaned_shm(shm_before) and not _scratch(actor_pid), 10.0), (
            orphaned_shm(shm_before),
            _scratch(actor_pid),
        )
    finally:  # the supervisor is the module's: no process of this test's may outlive it
        await sup.stop(pusher)


def _scratch(actor_pid: int) -> list[str]:
    import glob
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), f"asyncrl-vllm-{actor_pid}-*"))


async def _until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _all_gone(pids, timeout_s: float) -> bool:
    """Wait (without blocking the supervisor's loop) until none of ``pids`` is alive."""
    deadline = time.monotonic() + timeout_s
    while any(process_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _collect(stream) -> list:
    return [g async for g in stream]


_DRIVER = textwrap.dedent("""
    import asyncio, json, os, sys
    from asyncrl import Supervisor
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.sampler.actor import SamplerActor
    from conftest import descendants

    async def main():
        async with Supervisor(call_timeout_s=120, start_timeout_s=240) as sup:
            config = SamplerConfig(weight_update="pause", backend="vllm")
            device = sys.argv[4]
            s = await sup.spawn(SamplerActor, sys.argv[1], config, name="smp", env=json.loads(sys.argv[2]),
                                gpus=int(device == "cuda"), kwargs=dict(data=DataConfig(n_train=20, n_heldout=5),
                                                                        device=device,
                                                                        vllm={"engine": json.loads(sys.argv[3])}))
            await s.stats()
            pid = sup._records["smp"].proc.pid
            print(json.dumps({"pids": [pid, *descendants(pid)]}), flush=True)
            await asyncio.sleep(120)

    asyncio.run(main())
""")


def test_sigkill_of_the_supervisor_takes_vllms_engine_down(vllm_required, tiny_path, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen(
            [
                sys.executable,
                str(script),
                tiny_path,
                json.dumps({**VLLM_ENV, **MULTIPROCESS_EXECUTOR}),  # its worker's process must go too
                json.dumps(engine_options(vllm_required)),
                vllm_required.type,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    pids: list[int] = []
    shm_before = shm_names()
    try:
        info = _json_line(driver, 180.0)
        assert info, (tmp_path / "driver.err").read_text()[-3000:]
        pids = info["pids"]
        assert len(pids) >= 3 and all(process_alive(p) for p in pids)  # the actor, vLLM's engine core and worker
        driver.send_signal(signal.SIGKILL)
        driver.wait(5)
        assert wait_until(lambda: not any(process_alive(p) for p in pids), 10.0), "orphans survived"
        assert wait_until(lambda: not orphaned_shm(shm_before) and not _scratch(pids[0]), 10.0), (
            orphaned_shm(shm_before),
            _scratch(pids[0]),
        )
    finally:
        kill_all([driver.pid, *pids])
        driver.communicate(timeout=10)


def _json_line(proc: subprocess.Popen, timeout_s: float) -> dict | None:
    """The first line of ``proc``'s stdout that is a JSON object, waiting at most ``timeout_s``."""
    import selectors

    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(max(deadline - time.monotonic(), 0.0)):
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return json.loads(line)
    return None


def test_a_grpo_run_with_the_vllm_backend(vllm_required, tmp_path, model_cache):
    from test_grpo import TINY

    why = needs_two_devices(vllm_required)
    if why:
        pytest.skip(why)
    # On a GPU the engine's worker digests its weights (through the places the first sync checked,
    # which every later sync receives straight into): each sync's bytes are checked where vLLM reads them.
    device = ["--run.device", "cuda", "--run.check_weights", "true"] if vllm_required.type == "cuda" else []

    run_dir = tmp_path / "run"
    env = dict(os.environ, ASYNCRL_CACHE_DIR=model_cache, **VLLM_ENV)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "launch",
            os.path.join(ROOT, "examples", "grpo_countdown.py"),
            *TINY,
            *device,
            "--sampler.backend",
            "vllm",
            "--sampler.engine_stats",
            "true",
            "--run.run_dir",
            str(run_dir),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "vllm backend" in done.stdout + done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["sync_s"] > 0 for r in records)
    # Each step's record has the engine's own since the last (--sampler.engine_stats): it generated.
    assert all(r["engine_preemptions"] >= 0 and 0 <= r["engine_kv_cache_peak"] <= 1 for r in records), records
    assert any(r["engine_kv_cache_peak"] > 0 for r in records), records
    if device:
        for r in records:
            digests = r["weights_digests"]
            assert len(set(digests.values())) == 1 and "sampler0" in digests, r
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and json.loads((run_dir / "config.json").read_text())["sampler"]["backend"] == "vllm"


async def test_check_weights_is_refused_before_a_run_with_vllm_samplers_on_the_cpu(vllm_required, tiny_path, tmp_path):
    """vLLM on the CPU repacks its weights for its kernels: no digest of the tensors sent, so
    ``--run.check_weights`` is a config error at the start, not a sampler lost after every sync
    (on a GPU the engine's worker digests them: test_a_grpo_run_with_the_vllm_backend). vllm with
    the device left to the plan is resolved as the samplers will before anything starts: no actor,
    no run directory (it took an engine start, ~35-65 s on the 2-core machine, to be refused once a
    sampler said so). Auto picks hf on the CPU, so it runs, digests and all."""
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import ConfigError, parse_overrides
    from asyncrl.rl.driver.run import train

    if vllm_required.type == "cuda":
        pytest.skip("on a GPU --run.check_weights digests a vLLM sampler's weights")
    config = parse_overrides(
        GRPOConfig(model_path=tiny_path),
        [
            "--run.run_dir",
            str(tmp_path / "run"),
            "--run.n_train",
            "40",
            "--run.n_heldout",
            "8",
            "--sampler.backend",
            "vllm",
            "--run.check_weights",
            "true",
        ],
    )
    async with Supervisor(start_timeout_s=240, zygote_preload="") as sup:  # refused before any actor starts
        with pytest.raises(
            ConfigError,
            match=r"--sampler.backend vllm picks vLLM here \(cpu\), which repacks them on the CPU; add --sampler",
        ):
            await train(config, sup)
        assert sup.status() == [] and not (tmp_path / "run").exists()
