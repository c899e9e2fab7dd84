"""Faults of a GRPO run on GPUs (issue 47): vLLM samplers that take their weights over NCCL, killed
or frozen in the middle of a broadcast, and the trainer killed mid-run. Needs 2 CUDA devices (1
trainer + 1 sampler); with 3 or more the sampler faults run with 2 samplers, so the group re-forms
with the survivor while the lost one restarts. Mirrors tests/test_fault_tolerance.py (CPU, gloo).

* A sampler SIGKILLed in the transfer phase of the sync of v3: the trainer's side of the sync ends
  within ``--run.sync_timeout_s``; the group is re-formed with the others (one sampler: the run
  waits for its restart); the killed sampler restarts, rejoins with a new communicator and its
  groups are trained again. Every step once, each with its whole batch, no group trained twice;
  no process of the dead incarnation left, on the GPU (nvidia-smi) or anywhere.
* The same sampler SIGSTOPped there (frozen, not dead): found by the sync's deadline, killed by
  the driver, the same outcome.
* The trainer SIGKILLed mid-run, then ``--resume``: step for step the uninterrupted run, exactly.
  HF samplers (vLLM's sampling is not bit-reproducible run to run on a GPU: its batch composition
  and kernels vary with timing), one sampler, sync mode, the trainer's attention eager (no fused
  attention backward, whose atomics may sum in any order), no torch.compile, a fixed micro-batch
  budget (auto picks it from the free memory) and cuBLAS's deterministic workspace.
* Over 100 steps, every member (the trainer, each vLLM engine) created exactly one NCCL
  communicator: one per membership, none after a sync that succeeded.

The transfer phase is found by the member's own word: ``ASYNCRL_TEST_TRANSFER_HOOK``
(``asyncrl/comm/transfer_hook.py``) makes rank 1, at the start of its transfer of v3 (the first
vote passed on every member, no bucket moved), write its pid into a file and stall there; the test
waits for that file and signals the sampler whose process holds that pid (vLLM's engine process,
below the sampler actor). A sampler is killed as the CPU tests kill one, its actor's process (the
supervisor takes its process group, vLLM's engine included, with it), and frozen as a whole
(SIGSTOP to its process group).

The sampler faults run the run well past the fault (``--run.steps 2000``) and end it, as Ctrl-C
would, once the restarted sampler's groups were trained and two more steps followed: with a
survivor the run does not wait for the restart, and a fixed step count would race it.

``ASYNCRL_GPU_FAULTS_DRY_RUN=cpu`` runs the same scenarios on the CPU (gloo, HF samplers): the
test's own check where no GPUs are lent. ``ASYNCRL_GPU_FAULTS_SAMPLERS=N`` sets the sampler count
of the two sampler faults (default: 2 with 3 or more GPUs and in the dry run, else 1).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from asyncrl import Supervisor
from asyncrl.comm.transfer_hook import TRANSFER_HOOK_ENV
from asyncrl.rl.checkpoint import latest_checkpoint, list_checkpoints
from asyncrl.rl.driver.faults import TrainerLostError
from asyncrl.rl.driver.fleet.sync_group import SYNC_GRACE_S
from asyncrl.rl.driver.run import train
from asyncrl.runtime.devices import detect
from conftest import descendants, orphaned_shm, process_alive, shm_names
from test_fault_tolerance import ROOT, check_whole, records, tiny

DRY = os.environ.get("ASYNCRL_GPU_FAULTS_DRY_RUN") == "cpu"
kind, ids = detect("auto")
GPUS = len(ids) if kind == "cuda" and not DRY else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not DRY and GPUS < 2, reason="needs two CUDA devices"),
]
needs_vllm = pytest.mark.skipif(not DRY and importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

BACKEND = "gloo" if DRY else "nccl"
SYNC_TIMEOUT_S = 5.0
"""Short, so that the peers of a sampler killed mid-broadcast abort their communicators (and with
them any mapping of its NCCL buffers, which would keep that memory on its GPU allocated) before its
replacement's vLLM engine measures the GPU's free memory: vLLM fails its start if memory is given
back while it profiles. A healthy sync here takes milliseconds, the first of a group about a second."""
LOST_VERSION = 3
"""The sync whose transfer the sampler faults hit (step 3's)."""
GROUPS = 4  # tiny()'s --run.groups_per_step
CAP_STEPS = 2000
"""The sampler faults' --run.steps: far more than the steps a restart takes (the run is ended
once the restarted sampler trained)."""
LEFT_MIB = 256
"""GPU memory a GPU may hold beyond what it held before a test, once every process of the test
ended: less than one CUDA context (~500 MiB on an H100), far less than a vLLM engine."""
SAMPLERS = (
    ["--sampler.backend", "hf"]
    if DRY
    else [
        "--sampler.backend",
        "vllm",
        "--sampler.gpu_memory_utilization",
        "0.15",
        # No torch.compile, no CUDA graphs: an engine starts (and a killed one restarts) in seconds,
        # not a minute; the data plane and the faults are the same.
        "--sampler.vllm_args",
        json.dumps({"enforce_eager": True, "max_num_seqs": 32}),
    ]
)


def on_device(model_path: str, run_dir, *overrides: str):
    """test_fault_tolerance's tiny run on the GPUs (the dry run: on the CPU), with deadlines that
    let a vLLM sampler restart (an engine's start) while the run waits for it."""
    device = ["--run.device", "cpu"] if DRY else ["--run.device", "cuda", "--trainer.compile", "false"]
    return tiny(
        model_path,
        run_dir,
        *device,
        "--run.sync_timeout_s",
        f"{SYNC_TIMEOUT_S:g}",
        "--run.rendezvous_timeout_s",
        "60",
        "--run.restart_timeout_s",
        "300",
        "--run.generate_timeout_s",
        "120",
        "--run.queue_timeout_s",
        "400",
        "--run.train_timeout_s",
        "120",
        *overrides,
    )


def sampler_count() -> int:
    forced = os.environ.get("ASYNCRL_GPU_FAULTS_SAMPLERS")
    if forced:
        return int(forced)
    return 2 if DRY or GPUS >= 3 else 1


class HandleKeeper(Supervisor):
    """A supervisor that keeps the handle of every actor it spawns (a run does not hand them
    out), so a test can ask the trainer and each sampler what they hold."""

    def __init__(self, **overrides):
        super().__init__(**overrides)
        self.handles = {}

    async def spawn(self, cls, *args, **kwargs):
        handle = await super().spawn(cls, *args, **kwargs)
        self.handles[handle.name] = handle
        return handle


async def until(predicate, timeout_s: float, what, run: asyncio.Future | None = None, interval_s: float = 0.02):
    """Poll ``predicate`` until it returns something true, and return that (tests only: watching
    files and processes from outside). Fails after ``timeout_s``, or as soon as ``run`` ended
    (with its own error, if it raised). ``what``: a text, or a callable giving one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if run is not None and run.done():
            run.result()
            raise AssertionError(f"the run ended before {what() if callable(what) else what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what() if callable(what) else what}")
        await asyncio.sleep(interval_s)


def records_so_far(run_dir) -> list[dict]:
    """metrics.jsonl of a run still writing it (a last line being written is not read yet)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines[:-1]]


def fault_events(run_dir, event: str, sampler: str) -> list[dict]:
    with open(os.path.join(run_dir, "faults.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == event and e.get("sampler") == sampler]


def first_step_of(recs: list[dict], sampler: str, after_incarnation: int) -> int:
    """The first step that trained a group of an incarnation of ``sampler`` newer than
    ``after_incarnation`` (0: none yet). Group ids are ``sampler/incarnation/sequence``."""
    for r in recs:
        for uid in r["group_ids"]:
            name, incarnation, _ = uid.split("/")
            if name == sampler and int(incarnation) > after_incarnation:
                return r["step"]
    return 0


def owner_of(sup, pid: int):
    """The running sampler whose process is ``pid`` or holds it below (vLLM's engine)."""
    for s in sup.status():
        if s.name.startswith("sampler") and s.pid and (s.pid == pid or pid in descendants(s.pid)):
            return s
    raise AssertionError(f"process {pid}, which began the transfer, is no sampler's: {sup.status()}")


def nvidia_smi(query: str) -> list[list[str]]:
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [[field.strip() for field in line.split(",")] for line in done.stdout.splitlines() if line.strip()]


def gpu_memory_mib() -> dict[str, int]:
    """Memory in use on each GPU (nvidia-smi's index -> MiB); none in the dry run."""
    return {} if DRY else {index: int(used) for index, used in nvidia_smi("--query-gpu=index,memory.used")}


def gpu_processes() -> dict[int, str]:
    """The processes holding GPU memory as nvidia-smi lists them (pid -> MiB). In a container
    with a pid namespace of its own it may list none of ours: `gpu_memory_mib` then decides."""
    rows = nvidia_smi("--query-compute-apps=pid,used_memory")
    return {int(row[0]): row[1] for row in rows if row[0].isdigit()}


@dataclass
class SamplerFault:
    """What a sampler fault test saw (``lose_a_sampler_mid_transfer``)."""

    count: int
    began: dict  # the transfer hook's file: pid, rank, version, at
    victim: str
    incarnation: int  # the victim's incarnation that was hit
    hit_at: float  # time.time() of the signal
    lines: list[tuple[float, str]]  # the run's log, each line with its time.time()
    recs: list[dict]
    created: dict[str, dict[str, int]]  # each actor's communicators, by backend
    restarts: dict[str, int]


async def lose_a_sampler_mid_transfer(model_path: str, tmp_path, monkeypatch, signum: int) -> SamplerFault:
    """A run whose sampler at rank 1 is hit by ``signum`` (SIGKILL to its actor's process,
    SIGSTOP to its whole process group) in the transfer of v3; it goes on until that sampler's next
    incarnation had groups trained and two steps followed, then it is ended as by Ctrl-C. Checks
    what holds for either fault: every step once and whole, no group twice, a restart that
    rejoined and trained, one communicator per membership, nothing of the dead process left."""
    count = sampler_count()
    claim = tmp_path / "transfer-began.json"
    monkeypatch.setenv(TRANSFER_HOOK_ENV, f"1:{LOST_VERSION}:120:{claim}")  # the actors inherit it
    run_dir = tmp_path / "run"
    config = on_device(model_path, run_dir, "--run.steps", str(CAP_STEPS), "--sampler.count", str(count), *SAMPLERS)
    memory_before, shm_before = gpu_memory_mib(), shm_names()
    lines: list[tuple[float, str]] = []

    def log(line: str) -> None:
        lines.append((time.time(), line))
        print(f"{time.time():.2f} {line}", flush=True)  # shown with -rP

    # The supervisor's heartbeat check (15 s by default) would kill a frozen sampler near the
    # driver's verdict (sync_timeout_s + 5 s): it is the sync's deadline that must find it here.
    async with HandleKeeper(heartbeat_timeout_s=120) as sup:
        run = asyncio.ensure_future(train(config, sup, log=log))
        try:
            began = json.loads(
                await until(lambda: claim.exists() and claim.read_text(), 600, f"the transfer of v{LOST_VERSION}", run)
            )
            victim = owner_of(sup, began["pid"])
            doomed = {victim.pid, *descendants(victim.pid)}  # the actor, vLLM's engine processes
            if signum == signal.SIGKILL:
                os.kill(victim.pid, signal.SIGKILL)
            else:
                os.killpg(victim.pid, signal.SIGSTOP)  # the actor leads its group (vLLM's engine in it)
            hit_at = time.time()
            print(f"{hit_at:.2f} test: {signal.Signals(signum).name} to {victim.name} ({sorted(doomed)})", flush=True)
            back = await until(
                lambda: first_step_of(records_so_far(run_dir), victim.name, victim.incarnation),
                600,
                f"a step trained groups of {victim.name}'s next incarnation",
                run,
                interval_s=0.1,
            )
            await until(lambda: len(records_so_far(run_dir)) >= back + 2, 120, f"step {back + 2}", run, 0.1)
        finally:
            run.cancel()  # as Ctrl-C ends a run
            await asyncio.gather(run, return_exceptions=True)
        created = {name: await h.with_timeout(60).sync_created() for name, h in sup.handles.items()}
        restarts = {s.name: s.restarts for s in sup.status()}
        # The hit incarnation is gone, all of it: no process left, none holding GPU memory.
        await until(
            lambda: not [p for p in doomed if process_alive(p)],
            30,
            lambda: f"processes of {victim.name}'s dead incarnation alive: {[p for p in doomed if process_alive(p)]}",
        )
        if not DRY:
            holding = await asyncio.to_thread(gpu_processes)
            actors = {s.name: s.pid for s in sup.status()}
            print(f"test: GPU memory (MiB) by pid while {actors} still run: {holding}")
            assert not doomed & holding.keys(), (sorted(doomed), holding)
    if not DRY:  # every process of the test ended: each GPU holds what it held before it
        await until(
            lambda: all(used <= memory_before.get(i, 0) + LEFT_MIB for i, used in gpu_memory_mib().items()),
            30,
            lambda: f"GPU memory (MiB) before the test {memory_before}, after it {gpu_memory_mib()}",
            interval_s=0.5,
        )
    await until(lambda: not orphaned_shm(shm_before), 10, lambda: f"shared memory left: {orphaned_shm(shm_before)}")

    recs = check_whole(run_dir, len(records(run_dir)), GROUPS, digests=False)
    assert (began["rank"], began["version"]) == (1, LOST_VERSION), began
    (lost,) = fault_events(run_dir, "lost", victim.name)
    assert lost["incarnation"] == victim.incarnation and lost["step"] == LOST_VERSION, lost
    (rejoined,) = fault_events(run_dir, "rejoined", victim.name)
    assert rejoined["incarnation"] > victim.incarnation, rejoined
    assert fault_events(run_dir, "recovered", victim.name), "the group was never whole again"
    # Restarted (once, unless a start of the replacement failed and was tried again: see the log),
    # and nothing else was.
    assert restarts[victim.name] >= 1 and all(n == 0 for name, n in restarts.items() if name != victim.name), restarts
    # Before the fault every step trained the first incarnations' groups; after it, the next one's.
    assert all(uid.split("/")[1] == "1" for r in recs[: LOST_VERSION - 1] for uid in r["group_ids"]), recs
    assert first_step_of(recs, victim.name, victim.incarnation) > LOST_VERSION
    if count > 1:  # the group re-formed with the survivors, without waiting for the restart
        assert recs[LOST_VERSION - 1]["generation"] == 1, recs[LOST_VERSION - 1]
        assert recs[LOST_VERSION - 1]["samplers_in_group"] == count - 1, recs[LOST_VERSION - 1]
    assert recs[-1]["samplers_in_group"] == count, recs[-1]
    # A communicator per membership: the trainer and each survivor one per generation of the group;
    # the restarted sampler one, made when it rejoined.
    memberships = recs[-1]["generation"] + 1
    survivors = {f"sampler{i}" for i in range(count)} - {victim.name}
    assert created == {
        "trainer": {BACKEND: memberships},
        victim.name: {BACKEND: 1},
        **{name: {BACKEND: memberships} for name in survivors},
    }, (created, memberships)
    print(f"test: {len(recs)} steps; generations {memberships}; communicators {created}; restarts {restarts}")
    return SamplerFault(count, began, victim.name, victim.incarnation, hit_at, lines, recs, created, restarts)


def failed_sync(seen: SamplerFault) -> tuple[float, str]:
    """The log line (and its time) saying the sync hit by the fault failed, with each member's error."""
    failed = [(at, line) for at, line in seen.lines if line.startswith(f"the weight sync of v{LOST_VERSION} failed")]
    assert failed, [line for _, line in seen.lines]
    return failed[0]


@needs_vllm
async def test_a_sampler_sigkilled_mid_broadcast_is_replaced_and_the_run_goes_on(model_path, tmp_path, monkeypatch):
    seen = await lose_a_sampler_mid_transfer(model_path, tmp_path, monkeypatch, signal.SIGKILL)
    (lost,) = fault_events(tmp_path / "run", "lost", seen.victim)
    assert "died" in lost["detail"] and lost["at"] - seen.hit_at < 5.0, lost  # its death, noticed at once
    at, line = failed_sync(seen)
    # Every member's side of the sync ended within its own deadline: the trainer's with a typed
    # collective error (a survivor's too), the dead sampler's call at once.
    ended_s = at - seen.began["at"]
    print(f"test: the sync of v{LOST_VERSION} ended {ended_s:.2f} s after the transfer began: {line}")
    assert "actor 'trainer': send_weights() raised Collective" in line, line
    assert ended_s < SYNC_TIMEOUT_S + 3.0, (ended_s, line)


@needs_vllm
async def test_a_sampler_frozen_mid_broadcast_is_found_by_the_deadline_and_replaced(model_path, tmp_path, monkeypatch):
    seen = await lose_a_sampler_mid_transfer(model_path, tmp_path, monkeypatch, signal.SIGSTOP)
    (lost,) = fault_events(tmp_path / "run", "lost", seen.victim)
    assert f"no answer during the weight sync of v{LOST_VERSION}" in lost["detail"], lost
    found_s = lost["at"] - seen.began["at"]
    print(f"test: the frozen {seen.victim} was judged lost {found_s:.2f} s after its transfer began")
    # Not before the sync's deadline, and within it and the grace the driver allows past it.
    assert SYNC_TIMEOUT_S - 1.0 <= found_s < SYNC_TIMEOUT_S + SYNC_GRACE_S + 3.0, found_s
    _, line = failed_sync(seen)
    assert "actor 'trainer': send_weights() raised CollectiveTimeoutError" in line, line  # its own deadline


async def test_trainer_sigkill_then_resume_matches_an_uninterrupted_run(model_path, tmp_path, monkeypatch):
    """test_fault_tolerance's resume test with the trainer and its sampler on GPUs (see the module
    docstring for what makes a GPU run repeat itself bit for bit)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the actors and the resume inherit it
    args = (
        "--run.steps",
        "6",
        "--run.mode",
        "sync",
        "--sampler.count",
        "1",
        "--sampler.prompts_per_batch",
        "4",
        "--run.checkpoint_every",
        "2",
        "--run.keep_checkpoints",
        "2",
        "--trainer.micro_batch_tokens",
        "16384",
        "--trainer.attn_implementation",
        "eager",
    )
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    async with Supervisor() as sup:
        await train(on_device(model_path, whole, *args), sup, log=lambda *a: None)

    async with Supervisor() as sup:
        run = asyncio.ensure_future(train(on_device(model_path, broken, *args), sup, log=lambda *a: None))
        try:
            written = broken / "checkpoints" / "step-00000002"
            await until(written.exists, 300, "the checkpoint of step 2", run)
            (trainer,) = [s for s in sup.status() if s.name == "trainer"]
            os.kill(trainer.pid, signal.SIGKILL)
            with pytest.raises(TrainerLostError) as info:
                await run
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    assert "the trainer died" in str(info.value) and f"--resume {broken}" in str(info.value)
    assert latest_checkpoint(str(broken)).step == 2

    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "asyncrl.cli", "launch", os.path.join(ROOT, "examples", "grpo_countdown.py")]
        + ["--resume", str(broken)],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resuming from" in done.stdout
    a, b = records(whole), records(broken)
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        for key in ("reward_mean", "loss", "pg_loss", "grad_norm", "entropy", "completion_tokens", "version"):
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    assert all(r["grad_norm"] > 0 for r in a[:2]) and any(r["grad_norm"] > 0 for r in a[2:])  # see the CPU test
    assert [c.step for c in list_checkpoints(str(broken))] == [4, 6]

    from safetensors.torch import load_file

    wa = load_file(str(whole / "final" / "model.safetensors"))
    wb = load_file(str(broken / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@needs_vllm
async def test_every_member_creates_one_communicator_over_a_hundred_syncs(model_path, tmp_path):
    steps = 100
    count = max(1, min(3, GPUS - 1)) if not DRY else 2
    run_dir = tmp_path / "run"
    config = on_device(model_path, run_dir, "--run.steps", str(steps), "--sampler.count", str(count), *SAMPLERS)
    async with HandleKeeper() as sup:
        await train(config, sup, log=lambda *a: None)
        created = {name: await h.with_timeout(60).sync_created() for name, h in sup.handles.items()}
    recs = check_whole(run_dir, steps, GROUPS, digests=False)
    # One membership all along (generation 0, every sampler in it, no loss), and a sync every step.
    assert all(r["generation"] == 0 and r["samplers_in_group"] == count for r in recs), recs
    assert not any(r["sampler_losses"] for r in recs) and all(r["sync_s"] > 0 for r in recs)
    print(f"test: {steps} syncs to {count} sampler(s); communicators {created}")
    assert created == {"trainer": {BACKEND: 1}, **{f"sampler{i}": {BACKEND: 1} for i in range(count)}}, created
