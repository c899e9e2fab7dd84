"""A run that stops, resumes and ends well (CPU, gloo, real processes where they are involved):

* checkpoints carry a manifest; a damaged newest one is skipped (one line says so) and the resume
  falls back to the newest good one; with none good, one `CheckpointError` line, and nothing in the
  run directory changed;
* group ids stay unique across a resume (the run segment is part of them);
* a full disk at a checkpoint is one line naming the disk problem and the path, with no debris;
* the best held-out policy is kept in best/ with best.json; the summary names final/ and best/;
* SIGINT through ``asyncrl launch``: the resume line, a ``stopped`` event in faults.jsonl, the
  console kept in log.txt; ``--resume`` with no checkpoint: one line, exit status 2.

The runs use the 64-wide one-layer model of tests/test_fault_tolerance.py (warm-started once per
module, about 10 s)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from asyncrl import Supervisor
from asyncrl.rl.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    DamagedCheckpointError,
    list_checkpoints,
    verify_checkpoint,
    write_reason,
)
from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import parse_overrides
from asyncrl.rl.driver.heldout import HeldoutRecord
from asyncrl.rl.driver.run import train
from asyncrl.rl.driver.run_state import RunState, read_run_state
from asyncrl.rl.driver.saving import RunDirError, run_dir_error
from asyncrl.rl.observe import report, runlog
from asyncrl.rl.trainer.checkpoint import FAIL_ENV, write_checkpoint
from asyncrl.runtime import files
from asyncrl.runtime.files import write_json_atomic
from conftest import command_line, descendants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("actor_zygote")]  # tests/conftest.py: forked actors


# --- without processes ----------------------------------------------------------------------------


class _Saves:
    """Stands in for a model or a tokenizer: ``save_pretrained`` writes one file."""

    def __init__(self, name: str, data: bytes):
        self.name, self.data = name, data

    def save_pretrained(self, folder: str, **_) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, self.name), "wb") as f:
            f.write(self.data)


def _write(run_dir, step: int) -> str:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    return write_checkpoint(
        str(run_dir),
        step,
        5,
        _Saves("model.safetensors", b"w" * 1000),
        _Saves("tokenizer.json", b"{}"),
        optimizer,
        step,
        msgspec.json.encode(RunState(step=step, version=step, segment=1)),
    )


def test_the_manifest_tells_a_whole_checkpoint_from_a_damaged_one(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _write(tmp_path, step)
    c1, c2, c3, c4, c5 = list_checkpoints(str(tmp_path))
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000005" / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {
        "model/model.safetensors",
        "model/tokenizer.json",
        "trainer.pt",
        "trainer.json",
        "run_state.json",
    }
    assert verify_checkpoint(c5) is True and read_run_state(c5).segment == 1

    size = os.path.getsize(os.path.join(c5.path, "trainer.pt"))
    open(os.path.join(c5.path, "trainer.pt"), "w").close()  # zeroed
    with pytest.raises(
        DamagedCheckpointError,
        match=rf"^checkpoint step-5 is damaged \(trainer.pt: size 0, "
        rf"expected {size}\)$",
    ):
        verify_checkpoint(c5)
    path = os.path.join(c4.path, "model", "model.safetensors")
    with open(path, "r+b") as f:  # same size, other bytes
        f.write(b"x")
    with pytest.raises(DamagedCheckpointError, match=r"model/model.safetensors: contents differ from the manifest"):
        verify_checkpoint(c4)
    (tmp_path / "checkpoints" / "step-00000003" / "MANIFEST.json").write_text('{"files": {"trainer.pt": ')
    with pytest.raises(DamagedCheckpointError, match=r"step-3 is damaged \(MANIFEST.json: unreadable"):
        verify_checkpoint(c3)
    os.unlink(os.path.join(c2.path, "MANIFEST.json"))  # as an older version wrote them: accepted unverified
    assert verify_checkpoint(c2) is False
    with open(os.path.join(c1.path, "run_state.json"), "w") as f:
        f.write("{garbled")
    os.unlink(os.path.join(c1.path, "MANIFEST.json"))
    assert verify_checkpoint(c1) is False  # its files are there; the run state is the driver's to read
    with pytest.raises(DamagedCheckpointError, match=r"step-1 is damaged \(run_state.json: not a valid run state"):
        read_run_state(c1)


def test_a_failed_checkpoint_write_is_one_line_and_leaves_no_debris(tmp_path, monkeypatch):
    _write(tmp_path, 1)
    monkeypatch.setenv(FAIL_ENV, "2")  # ENOSPC after the model files, as a full disk would
    with pytest.raises(CheckpointWriteError) as info:
        _write(tmp_path, 2)
    assert str(info.value) == (
        f"cannot write the checkpoint of step 2 to {tmp_path}/checkpoints: No space left on device"
    )
    assert os.listdir(tmp_path / "checkpoints") == ["step-00000001"]

    # torch.save reports a full disk as "file write failed": the disk is looked at then, and named.
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(30 << 20, 30 << 20, 4096))
    monkeypatch.setattr(files, "_device_of", lambda mount: "tmpfs")
    named = (
        f"No space left on device (tmpfs at {files.disk_space(str(tmp_path)).mount} has 4 KiB free of 30 MiB: "
        "free space there before resuming)"
    )
    assert write_reason(RuntimeError("[enforce fail] file write failed"), str(tmp_path)) == named
    assert write_reason(RuntimeError("Error: IoError(StorageFull)"), str(tmp_path)) == named
    assert write_reason(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), str(tmp_path / "no" / "such")) == named
    assert write_reason(OSError(errno.EIO, os.strerror(errno.EIO)), str(tmp_path)) == "Input/output error"
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(30 << 20, 0, 30 << 20))
    assert write_reason(RuntimeError("unexpected pos 2 vs 1"), str(tmp_path)) == "RuntimeError: unexpected pos 2 vs 1"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # The disk fills up once the temporary file is written: it must not stay behind.
    monkeypatch.setattr(files.os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomic(str(tmp_path / "progress.json"), {"step": 1})
    assert not [n for n in os.listdir(tmp_path) if "progress.json" in n]


def test_a_disk_that_fills_up_is_named_though_torch_save_says_unexpected_pos(tmp_path, monkeypatch):
    """A 30 MB tmpfs as the run directory: torch.save's short write reads "unexpected pos", and
    once the partial checkpoint is removed the disk has room again. The error is worded before
    that, so it names the disk and the free space, and says what to do (no root, no mount: the
    filesystem is full while a .tmp-* directory is there, as it was)."""
    _write(tmp_path, 1)
    checkpoints = tmp_path / "checkpoints"

    def usage(path):  # 4 KiB free while the partial write is there, 20 MiB once it is gone
        writing = any(name.startswith(".tmp-") for name in os.listdir(checkpoints))
        return shutil._ntuple_diskusage(30 << 20, 10 << 20, 4096 if writing else 20 << 20)

    def short_write(obj, path):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2586048 vs 2585936")

    monkeypatch.setattr(files.shutil, "disk_usage", usage)
    monkeypatch.setattr(files, "_device_of", lambda mount: "tmpfs")
    monkeypatch.setattr(torch, "save", short_write)
    with pytest.raises(CheckpointWriteError) as info:
        _write(tmp_path, 2)
    mount = files.disk_space(str(tmp_path)).mount
    assert str(info.value) == (
        f"cannot write the checkpoint of step 2 to {checkpoints}: No space left on device "
        f"(tmpfs at {mount} has 4 KiB free of 30 MiB: free space there before resuming)"
    )
    assert os.listdir(checkpoints) == ["step-00000001"]  # and no debris

    # The driver's own writes (progress.json, metrics.jsonl) fail as an OSError: worded the same way.
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(30 << 20, 30 << 20, 0))
    metrics = str(tmp_path / "metrics.jsonl")
    assert str(run_dir_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), metrics), str(tmp_path))) == (
        f"cannot write {metrics}: No space left on device (tmpfs at {mount} has 0 B free of 30 MiB: free space "
        "there before resuming)"
    )


MAIN_SUMMARY = {
    "steps": 4,
    "mode": "async",
    "heldout_before": {"greedy": 0.0, "sampled": 0.0},
    "heldout_after": {"greedy": 0.0, "sampled": 0.0},
    "heldout_problems": 8,
    "wall_s": 2.2278114360015024,
    "samples": 16,
    "samples_per_s": 7.181936380000344,
    "tokens_per_s": 86.18323656000413,
    "dropped_stale": 0,
    "uniform_skipped": 10,
    "checkpoint": "/tmp/run/final",
    "final": "/tmp/run/final",
    "best": None,
    "initial_policy": "/tmp/cache/models/7ad7f6eb986a4976350c",
    "metrics": "/tmp/run/metrics.jsonl",
    "log": "/tmp/run/log.txt",
    "curves": "/tmp/run/curves.png",
    "tensorboard": "/tmp/run",
    "resumed_from": None,
    "faults": {"sampler_losses": 0, "sampler_rejoins": 0, "rebuilds": 1},
    "fault_log": [],
}
"""summary.json of a default run as main wrote it (a dict, json.dump with indent 2) before it was typed."""


def test_the_summary_json_is_written_as_main_wrote_it(tmp_path):
    report.RunSummary(**MAIN_SUMMARY).write(str(tmp_path / "summary.json"))
    with open(tmp_path / "main.json", "w") as f:
        json.dump(MAIN_SUMMARY, f, indent=2)
    assert (tmp_path / "summary.json").read_text() == (tmp_path / "main.json").read_text()


def test_the_summary_states_the_gain_and_where_things_are(tmp_path):
    summary = report.RunSummary(
        steps=500,
        mode="async",
        wall_s=434.4,
        resumed_from=None,
        heldout_problems=500,
        heldout_before={"greedy": 0.256, "sampled": 0.128},
        heldout_after={"greedy": 0.284, "sampled": 0.245},
        samples=63800,
        samples_per_s=147.0,
        tokens_per_s=4000.0,
        dropped_stale=3,
        uniform_skipped=0,
        faults={},
        fault_log=[],
        checkpoint=str(tmp_path / "final"),
        final=str(tmp_path / "final"),
        best={"path": str(tmp_path / "best"), "step": 400, "heldout": {"greedy": 0.37}},
        initial_policy="/m",
        metrics=str(tmp_path / "metrics.jsonl"),
        log=str(tmp_path / "log.txt"),
        curves="",
        tensorboard="",
    )
    text = report.summary_text(summary)
    lines = text.splitlines()
    assert lines[0] == "GRPO finished: 500 steps in 7 min 14 s (async mode)"
    assert any(line.split() == ["held-out", "greedy", "0.256", "->", "0.284", "(+2.8", "points)"] for line in lines)
    assert any(line.split() == ["held-out", "sampled", "0.128", "->", "0.245", "(+11.7", "points)"] for line in lines)
    assert f"{tmp_path}/best  (step 400: held-out greedy 0.370)" in text and f"{tmp_path}/final" in text
    assert f"{tmp_path}/metrics.jsonl" in text
    text = report.summary_text(msgspec.structs.replace(summary, best=None))
    assert "the starting one, /m  (no evaluation beat its held-out greedy 0.256)" in text


def test_the_run_log_keeps_what_the_terminal_shows(tmp_path):
    lines: list[str] = []
    log = runlog.RunLog(str(tmp_path / "log.txt"), lines.append)
    with log:
        log.log("held back until the run directory is ours")
        print("\rstep 1/9", end="")
        print("\rstep 2/9", end="")
        print("\rstep 3/9 held-out 0.25")
        print("to stderr", file=sys.stderr)
        log.open("new run")
        print("partial", end="")
    print("after: not kept")
    kept = (tmp_path / "log.txt").read_text().splitlines()
    assert kept[1:] == ["held back until the run directory is ours", "step 3/9 held-out 0.25", "to stderr", "partial"]
    assert kept[0].startswith("--- ") and kept[0].endswith(" new run ---") and lines == [kept[1]]

    dropped = runlog.RunLog(str(tmp_path / "never.txt"), print)
    with dropped:
        print("a resume that was refused")
    assert not (tmp_path / "never.txt").exists()


# --- with processes -------------------------------------------------------------------------------


TINY = (
    "--run.groups_per_step",
    "4",
    "--sampler.group_size",
    "4",
    "--sampler.prompts_per_batch",
    "4",
    "--sampler.max_new_tokens",
    "24",
    "--run.n_train",
    "400",
    "--run.n_heldout",
    "8",
    "--run.eval_every",
    "1000",
    "--run.eval_samples",
    "0",
    "--run.checkpoint_every",
    "0",
    "--run.mode",
    "sync",
    "--run.generate_timeout_s",
    "30",
    "--run.queue_timeout_s",
    "90",
    "--run.train_timeout_s",
    "60",
    "--run.sync_timeout_s",
    "10",
    "--run.rendezvous_timeout_s",
    "20",
    "--run.restart_timeout_s",
    "60",
    "--run.eval_timeout_s",
    "60",
    "--run.checkpoint_timeout_s",
    "60",
    "--sampler.backend",
    "hf",
    "--run.curves",
    "false",  # no curves.png: matplotlib's seconds at every run's end; test_observe.py draws it
)


def tiny(model_path: str, run_dir, *overrides: str) -> GRPOConfig:
    return parse_overrides(GRPOConfig(model_path=model_path), ["--run.run_dir", str(run_dir), *TINY, *overrides])


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def events(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "faults.jsonl")) as f:
        return [json.loads(line) for line in f]


def snapshot(run_dir) -> dict[str, bytes]:
    """Every file of the run directory but the supervisor's (a status endpoint, removed at its close)."""
    out = {}
    for parent, _, names in os.walk(run_dir):
        for name in names:
            if name != "supervisor.json":
                path = os.path.join(parent, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, run_dir)] = f.read()
    return out


async def test_a_damaged_checkpoint_is_skipped_and_group_ids_stay_unique_across_the_resume(
    model_path, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    # Every evaluation of the first segment counts as a new best until one does not beat the last:
    # with the real rule (beat the policy before GRPO) a 4-step run of a tiny model might save none.
    monkeypatch.setattr(
        HeldoutRecord, "best_greedy", lambda self: self.best["heldout"]["greedy"] if self.best else -1.0
    )
    async with Supervisor() as sup:
        first = await train(
            tiny(model_path, run_dir, "--run.steps", "4", "--run.checkpoint_every", "2", "--run.eval_every", "1"),
            sup,
            log=lambda *a: None,
        )
    monkeypatch.undo()
    evaluated = [(r["heldout_solve_rate"], r["step"]) for r in records(run_dir)]
    best_rate = max(rate for rate, _ in evaluated)
    best_step = min(step for rate, step in evaluated if rate == best_rate)
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert (best["step"], best["heldout"]["greedy"]) == (best_step, best_rate) == (first["best"]["step"], best_rate)
    assert first["best"]["path"] == str(run_dir / "best") and first["final"] == str(run_dir / "final")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(run_dir / "best"), local_files_only=True)

    # Both checkpoints damaged: one line, no actor started, not a byte of the run directory changed.
    latest = run_dir / "checkpoints" / "step-00000004" / "trainer.pt"
    size = latest.stat().st_size
    latest.write_bytes(b"")
    state = run_dir / "checkpoints" / "step-00000002" / "run_state.json"
    good_state = state.read_bytes()
    state.write_bytes(b"{" + good_state[1:-1].replace(b'"', b"'") + b"}")  # garbled JSON, same size
    before = snapshot(run_dir)
    async with Supervisor(zygote_preload="") as sup:  # refused before any actor: a zygote's imports would go unused
        with pytest.raises(CheckpointError) as info:
            await train(tiny(model_path, run_dir, "--run.steps", "6"), sup, resume=True, log=lambda *a: None)
        assert sup.status() == []
    assert "\n" not in str(info.value) and str(info.value) == (
        f"--resume {run_dir}: no usable checkpoint: checkpoint step-4 is damaged (trainer.pt: size 0, "
        f"expected {size}); checkpoint step-2 is damaged (run_state.json: contents differ from the manifest (SHA-256 "
        + str(info.value).split("SHA-256 ", 1)[1]
    )
    assert snapshot(run_dir) == before

    # step-2 good again: the resume says what it skipped and continues from step 2.
    state.write_bytes(good_state)
    logs: list[str] = []
    async with Supervisor() as sup:
        summary = await train(tiny(model_path, run_dir, "--run.steps", "6"), sup, resume=True, log=logs.append)
    assert f"checkpoint step-4 is damaged (trainer.pt: size 0, expected {size}); resuming from step-2" in logs
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    uids = [uid for r in recs for uid in r["group_ids"]]
    assert len(uids) == 6 * 4 and len(set(uids)) == len(uids), "a group id was reused after the resume"
    assert all(uid.startswith("resume1/") for r in recs[2:] for uid in r["group_ids"])
    assert [c.step for c in list_checkpoints(str(run_dir))] == [2]  # no checkpoint_every on the resumed run
    assert (run_dir / "checkpoints" / "damaged-step-00000004" / "trainer.pt").stat().st_size == 0
    resumed = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == 2 and resumed[0]["segment"] == 1
    assert summary["best"]["step"] == best["step"] or summary["best"]["step"] > 2  # carried from best.json
    log_txt = (run_dir / "log.txt").read_text()
    assert "resuming from step-2" in log_txt and "GRPO finished: 6 steps in" in log_txt
    assert log_txt.count(" new run ---") == 1 and log_txt.count(" resumed from step-2 ---") == 1


async def test_a_full_disk_at_a_checkpoint_is_one_line_and_leaves_no_debris(model_path, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAIL_ENV, "2")  # the trainer inherits it: its write of step 2 fails with ENOSPC
    async with Supervisor() as sup:
        with pytest.raises(RunDirError) as info:
            await train(
                tiny(model_path, run_dir, "--run.steps", "4", "--run.checkpoint_every", "2"), sup, log=lambda *a: None
            )
    assert str(info.value) == (
        f"run stopped after step 2 (writing its checkpoint): cannot write the checkpoint of "
        f"step 2 to {run_dir}/checkpoints: No space left on device; no checkpoint was written "
        "yet; nothing to resume"
    )
    assert os.listdir(run_dir / "checkpoints") == []
    assert not [n for n in os.listdir(run_dir) if ".tmp-" in n]
    (stop,) = [e for e in events(run_dir) if e["event"] == "stopped"]
    assert stop["cause"] == "RunDirError" and "No space left on device" in stop["detail"]
    assert json.loads((run_dir / "progress.json").read_text())["phase"] == "stopped"


def launch(tmp_path, *args, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = os.path.join(ROOT, "examples", "grpo_countdown.py")
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "launch", script, *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_sigint_says_how_to_resume_and_records_the_stop(model_path, tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(
        tmp_path,
        "--model_path",
        model_path,
        "--run.run_dir",
        str(run_dir),
        *TINY,
        "--run.steps",
        "200",
        "--run.checkpoint_every",
        "2",
    )
    try:
        deadline = time.monotonic() + 150
        while not (run_dir / "checkpoints" / "step-00000002").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        # ps tells its processes apart: each titled by its role and the run (runtime/titles.py)
        shown = {command_line(pid) for pid in {proc.pid, *descendants(proc.pid)}}
        expected = {f"asyncrl: {role} [run]" for role in ("launch grpo_countdown.py", "zygote", "trainer", "sampler0")}
        assert expected <= shown, shown
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:] + err[-3000:]
    assert "asyncrl launch: stopped by SIGINT" in err
    (line,) = [line for line in out.splitlines() if "resume with:" in line]
    step = list_checkpoints(str(run_dir))[-1].step
    assert line.startswith("run stopped ") and " by SIGINT; resume with: asyncrl launch " in line
    # Paths as the user would type them in the directory the run was started from.
    assert line.endswith(f"{ROOT}/examples/grpo_countdown.py --resume run (checkpoint step {step})"), line
    stops = [e for e in events(run_dir) if e["event"] == "stopped"]
    assert len(stops) == 1 and stops[0]["cause"] == "SIGINT", stops
    # asyncrl scale (and status) on the stopped run: stopped, by what, and the same resume line
    scaled = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "scale", str(run_dir), "--samplers", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scaled.returncode == 1 and f" was stopped at step {stops[0]['step']} by SIGINT at " in scaled.stderr
    assert scaled.stderr.rstrip("\n").endswith(line.split("; ", 1)[1]), scaled.stderr
    log_txt = (run_dir / "log.txt").read_text()
    assert line in log_txt and f"run dir {run_dir}" in log_txt
    assert "held-out solve rate before GRPO (8 problems)" in log_txt and "[sampler0]: " in log_txt  # actors' output too

    # --resume of a run directory with no checkpoint: one line, exit status 2, nothing changed.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "config.json", bare / "config.json")
    proc = launch(tmp_path, "--resume", str(bare))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-3000:] + err[-3000:]
    (line,) = err.strip().splitlines()  # the example's one line: its own prefix, then the error
    assert line.endswith(
        f": --resume {bare}: no checkpoint was written yet (the first is written at step 2, "
        "--run.checkpoint_every 2); nothing to resume"
    ), err
    assert sorted(os.listdir(bare)) == ["config.json"]
