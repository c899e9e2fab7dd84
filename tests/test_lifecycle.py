"""Whole-process fault injection: SIGKILL the supervisor, SIGINT/SIGTERM `asyncrl launch`, and the
launcher's handling of scripts. Every process here is real; nothing may be left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import kill_all, orphaned_shm, process_alive, shm_names, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "launch", *args]


def _first_json_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            return json.loads(line)
    proc.kill()
    raise AssertionError(f"no JSON line from the driver; stderr:\n{proc.stderr.read()}")


def test_sigkill_of_the_supervisor_takes_every_child_down():
    driver = _start([sys.executable, os.path.join(SCRIPTS, "hold_actors.py")])
    info: dict = {"pids": []}
    try:
        info = _first_json_line(driver)
        assert all(process_alive(p) for p in info["pids"])
        driver.send_signal(signal.SIGKILL)
        driver.wait(5)
        start = time.monotonic()
        assert wait_until(lambda: not any(process_alive(p) for p in info["pids"]), 5.0), "orphans survived"
        elapsed = time.monotonic() - start
        assert elapsed < 5.0
    finally:
        kill_all([driver.pid, *info["pids"]])
        driver.communicate(timeout=5)
    # the run dir of a SIGKILLed supervisor is swept by the next one that starts
    assert os.path.isdir(info["run_dir"])
    from asyncrl.runtime.transport import remove_stale_run_dirs

    remove_stale_run_dirs()
    assert not os.path.exists(info["run_dir"])


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launch_stops_cleanly(sig, code):
    shm_before = shm_names()
    proc = _start(_launch(os.path.join(SCRIPTS, "hold_actors.py")))
    try:
        info = _first_json_line(proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in err
    assert "Traceback" not in err
    assert not any(process_alive(p) for p in info["pids"])
    assert not os.path.exists(info["run_dir"])  # socket files and their directory are gone
    assert not orphaned_shm(shm_before)


def test_a_second_sigint_while_closing_forces_exit_and_still_removes_the_socket_dirs(tmp_path):
    proc = _start([sys.executable, os.path.join(SCRIPTS, "slow_shutdown.py"), str(tmp_path)])
    info: dict = {"pids": []}
    try:
        info = _first_json_line(proc)
        status_dir = os.path.dirname(info["status_address"][len("ipc://") :])
        assert os.path.isdir(info["run_dir"]) and os.path.isdir(status_dir)
        assert (tmp_path / "supervisor.json").exists()
        assert _line(proc, "[held-1]: blocked"), "the actor did not block"
        proc.send_signal(signal.SIGINT)
        assert _line(proc, "closing"), "the first SIGINT did not start the shutdown"
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)  # the graceful stop waits for a blocked actor: stop waiting
        _, err = proc.communicate(timeout=20)
        assert time.monotonic() - start < 10.0  # not the 60 s stop_timeout_s of the blocked actor
    finally:
        kill_all([proc.pid, *info["pids"]])
        proc.communicate(timeout=5)
    assert proc.returncode == 130, err
    assert "SIGINT while shutting down: killing the actors and exiting now" in err
    assert wait_until(lambda: not any(process_alive(p) for p in info["pids"]), 5.0), "actors survived the forced exit"
    assert not os.path.exists(info["run_dir"])  # the supervisor's socket directory
    assert not os.path.exists(status_dir)  # the status server's
    assert not (tmp_path / "supervisor.json").exists()


def _line(proc: subprocess.Popen, wanted: str, timeout_s: float = 30.0) -> bool:
    """Read ``proc``'s stdout up to a line equal to ``wanted``; False at EOF or past ``timeout_s``
    (checked between lines: the script prints at once, or dies and closes its stdout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return False
        if line.strip() == wanted:
            return True
    return False


def test_sigterm_to_a_plain_python_script_exits_cleanly():
    proc = _start([sys.executable, os.path.join(SCRIPTS, "hold_actors.py")])
    try:
        info = _first_json_line(proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert not any(process_alive(p) for p in info["pids"])
    assert not os.path.exists(info["run_dir"])


def test_launch_runs_async_main_and_script_defined_actors():
    out = subprocess.run(
        _launch(os.path.join(SCRIPTS, "async_main.py")), env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "async main got 3" in out.stdout
    out = subprocess.run(
        _launch(os.path.join(SCRIPTS, "no_main.py")), env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "no-main script got 7 __main__" in out.stdout


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["sync-exit-code"], 3, ""),
        (["raise"], 1, "the script failed on purpose"),
        (["args", "--flag", "value"], 0, "args: ['args', '--flag', 'value']"),
    ],
)
def test_launch_exit_codes_and_arguments(args, code, text):
    out = subprocess.run(
        _launch(os.path.join(SCRIPTS, "modes.py"), *args), env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == code, out.stderr
    assert text in out.stdout + out.stderr


def test_launch_flags_configure_the_supervisor():
    argv = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "launch",
        "--transport",
        "tcp",
        "--call-timeout-s",
        "7",
        "--heartbeat-timeout-s",
        "9",
        os.path.join(SCRIPTS, "modes.py"),
        "config",
    ]
    out = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "config: tcp 7.0 9.0" in out.stdout


@pytest.mark.parametrize(
    "args, text",
    [
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "--node-rank must be in 0..1"),
        (["does/not/exist.py"], "no such script"),
        (["--heartbeat-timeout-s", "-1", os.path.join(SCRIPTS, "modes.py")], "heartbeat_timeout_s must be > 0"),
    ],
)
def test_launch_usage_errors(args, text):
    out = subprocess.run(_launch(*args), env=_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and text in out.stderr


def test_help_is_fast_and_does_not_import_torch():
    code = "import sys; from asyncrl.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "False"
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "launch" in out.stdout


def test_bad_node_variables_are_usage_errors():
    env = {**_env(), "NNODES": "many"}
    out = subprocess.run(
        _launch(os.path.join(SCRIPTS, "modes.py")), env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "--nnodes" in out.stderr
