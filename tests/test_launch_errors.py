"""What `asyncrl launch` shows when a script fails or is interrupted: a usage error is one line and
exit 2, ``sys.exit("message")`` prints the message (exit 1), a bug keeps its traceback, and a second
Ctrl-C during the shutdown ends the process at once, actors included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import kill_all, process_alive, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


def script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "launch", *args]


@pytest.mark.parametrize(
    "body, code, stderr",
    [
        (
            """
     from asyncrl.rl.config import ConfigError
     def main():
         raise ConfigError("--x 3: x must be even")
     """,
            2,
            "script.py: --x 3: x must be even\n",
        ),
        (
            """
     import sys
     async def main():
         sys.exit("cannot go on: no data")
     """,
            1,
            "cannot go on: no data\n",
        ),
        (
            """
     import sys
     sys.exit("a script without main stops here")
     """,
            1,
            "a script without main stops here\n",
        ),
    ],
)
def test_script_errors_are_one_line(tmp_path, body, code, stderr):
    done = subprocess.run(launch(script(tmp_path, body)), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (code, stderr)


def test_a_bug_keeps_its_traceback(tmp_path):
    path = script(
        tmp_path,
        """
        def main():
            return {}["missing"]
        """,
    )
    done = subprocess.run(launch(path), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" in done.stderr and "KeyError: 'missing'" in done.stderr


SLOW = """
    import asyncio, json, os, sys, time
    from asyncrl import Actor, Supervisor, endpoint

    class Slow(Actor):
        async def on_stop(self):
            await asyncio.sleep(float(os.environ["STOP_S"]))

        @endpoint
        async def getpid(self) -> int:
            return os.getpid()

    async def main():
        async with Supervisor(stop_timeout_s=60) as sup:
            actor = await sup.spawn(Slow, name="slow")
            # A thread nothing can interrupt, as the warm start's: the loop's close waits for it.
            busy = asyncio.ensure_future(asyncio.to_thread(time.sleep, 60))
            print(json.dumps({"pid": await actor.getpid()}), flush=True)
            await asyncio.sleep(60)
    """


@pytest.mark.parametrize(
    "stop_s, gap_s", [(60, 1.0), (0, 4.0)], ids=["during-the-actors-stop", "during-the-loop-close"]
)
def test_a_second_sigint_during_shutdown_exits_at_once(tmp_path, stop_s, gap_s):
    """First Ctrl-C: orderly shutdown, which here waits on a slow actor (60 s) or, once main()
    returned, on an executor thread (60 s). Second Ctrl-C: the actors' groups are killed and the
    process exits 130 at once, without the 'Event loop is closed' of an interrupted loop close."""
    env = dict(os.environ, STOP_S=str(stop_s), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        launch(script(tmp_path, SLOW)), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pid = None
    try:
        pid = json.loads(proc.stdout.readline())["pid"]
        proc.send_signal(signal.SIGINT)
        time.sleep(gap_s)
        assert proc.poll() is None, proc.stderr.read()  # still shutting down: the case under test
        second = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - second
    finally:
        kill_all([proc.pid] + ([pid] if pid else []))
    assert proc.returncode == 130, err
    assert took < 5.0, took
    assert "SIGINT while shutting down: killing the actors and exiting now" in err
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    assert wait_until(lambda: not process_alive(pid), 5.0)


def test_help_and_a_flag_error_do_not_import_torch(tmp_path):
    """The config is read and checked before any heavy import: --help and a usage error answer at once."""
    example = os.path.join(ROOT, "examples", "grpo_countdown.py")
    probe = (
        f"import sys; sys.argv = ['asyncrl', 'launch', {example!r}, '--help']; "
        "from asyncrl.cli import main; code = main(); "
        "print('torch' in sys.modules); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "False", done.stderr
    bad = probe.replace("'--help'", "'--trainer.lrr', '1'")
    done = subprocess.run([sys.executable, "-c", bad], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout.splitlines()[-1] == "False", done.stderr


NOT_READY = """
    import asyncio
    from asyncrl import Actor, Supervisor

    class NeverReady(Actor):
        async def on_start(self):
            await asyncio.sleep(60)

    async def main():
        async with Supervisor() as sup:
            await sup.spawn(NeverReady, name="sampler0")
    """

OUT_OF_MEMORY = """
    import sys
    from asyncrl import RemoteError, Supervisor
    from asyncrl.rl.trainer.out_of_memory import TrainerMemoryError
    from memory_actors import RunsOutOfMemory

    async def main():
        async with Supervisor() as sup:
            trainer = await sup.spawn(RunsOutOfMemory, name="trainer")
            try:
                await trainer.train_step()
            except TrainerMemoryError as exc:  # its own type across the process boundary, not a name
                assert isinstance(exc, RemoteError) and exc.remote_type == "TrainerMemoryError"
                raise
    """


TOO_BIG = """
    from asyncrl import Supervisor
    from memory_actors import PolicyTooBig

    async def main():
        async with Supervisor() as sup:
            await sup.spawn(PolicyTooBig, name="trainer")
    """


@pytest.mark.parametrize(
    "body, flags, line",
    [
        (
            NOT_READY,
            ["--start_timeout_s", "1"],
            "script.py: actor 'sampler0': not ready within start_timeout_s=1 (no start phase reported); raise it with "
            "asyncrl launch --start_timeout_s (or Supervisor(start_timeout_s=...))\n",
        ),
        (
            OUT_OF_MEMORY,
            [],
            "script.py: actor 'trainer': train_step() raised TrainerMemoryError: train step 1 ran out of cuda memory "
            "on a micro-batch of 8 x 512 tokens (--trainer.micro_batch_tokens 4096): lower that\n",
        ),
        (
            TOO_BIG,
            [],
            "script.py: actor 'trainer': the policy of /ckpt does not fit in the trainer's GPU's 79 GiB: train LoRA "
            "adapters (--trainer.lora.rank 16)\n",
        ),
    ],
    ids=["actor-not-ready", "trainer-out-of-memory", "policy-does-not-fit"],
)
def test_an_error_the_user_fixes_is_one_line_and_exit_1(tmp_path, body, flags, line):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    done = subprocess.run(
        launch(*flags, script(tmp_path, body)), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert (done.returncode, done.stderr) == (1, line)
