"""Processes a person can tell apart (runtime/titles.py): every actor titled ``asyncrl: NAME [RUN]``
in ``ps`` (its ``/proc/PID/cmdline``), forked from the zygote or started by ``Popen``, the zygote
and the launcher too; and an actor forked from the zygote shows the environment it was given, as
one started by ``Popen`` does (``/proc/PID/environ``, ``os.environ``, what its own children get),
not the zygote's. Real supervisors, real processes. A launched GRPO run's titles are checked in
test_run_lifecycle.py, on a live run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from actors import Exits
from asyncrl import Supervisor
from asyncrl.runtime import titles
from asyncrl.runtime.config import ENV_PREFIX
from asyncrl.runtime.zygotes import zygote
from conftest import command_line

RUN = "titles-run"


def proc_environ(pid: int) -> dict[str, str]:
    """What ``ps e`` and scripts read of a process's environment."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(entry.decode().split("=", 1) for entry in f.read().split(b"\0") if entry)


@pytest.fixture(autouse=True)
def light_zygote(monkeypatch):
    """As test_zygote.py's: only the worker preloaded, no device visible (where the zygote is used)."""
    monkeypatch.setenv(ENV_PREFIX + "ZYGOTE_PRELOAD", "asyncrl.runtime.worker")
    monkeypatch.delenv(zygote.ENV_ZYGOTE, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv(titles.ENV_RUN, RUN)


async def test_a_forked_actor_is_titled_by_its_name_and_run_and_shows_its_own_environment():
    async with Supervisor() as sup:
        assert sup._zygote is not None
        sampler = await sup.spawn(Exits, name="sampler1", env={"ASYNCRL_TEST_MARK": "sampler1's"})
        trainer = await sup.spawn(Exits, name="trainer")
        pid, zpid = await sampler.getpid(), sup._zygote.pid
        assert await sampler.parent() == zpid  # forked by the zygote
        assert command_line(pid) == f"asyncrl: sampler1 [{RUN}]"
        assert command_line(await trainer.getpid()) == f"asyncrl: trainer [{RUN}]"
        assert command_line(zpid) == f"asyncrl: zygote [{RUN}]"

        shown, inside, children = proc_environ(pid), await sampler.environ(), await sampler.spawned_environ()
        assert shown["ASYNCRL_ACTOR"] == "sampler1" and shown["ASYNCRL_TEST_MARK"] == "sampler1's"
        assert zygote.ENV_PRELOAD not in shown and titles.ENV_ROOM not in shown  # not the zygote's
        assert zygote.ENV_PRELOAD in proc_environ(zpid)
        assert shown == inside == children  # what ps shows is what the actor and its children have
        assert proc_environ(await trainer.getpid())["ASYNCRL_ACTOR"] == "trainer"


async def test_an_actor_started_by_popen_is_titled_and_its_environment_stays_readable(monkeypatch):
    monkeypatch.setenv(zygote.ENV_ZYGOTE, "0")
    async with Supervisor() as sup:
        assert sup._zygote is None
        actor = await sup.spawn(Exits, name="scorer")
        pid = await actor.getpid()
        assert await actor.parent() == os.getpid()
        assert command_line(pid) == f"asyncrl: scorer [{RUN}]"
        shown = proc_environ(pid)
        assert shown["ASYNCRL_ACTOR"] == "scorer"  # the title did not take the environment's memory
        assert shown == await actor.environ() == await actor.spawned_environ()
        assert "SPT_NOENV" not in shown  # the title's setting is not passed on


async def test_without_a_run_name_an_actor_is_titled_by_its_name(monkeypatch):
    monkeypatch.delenv(titles.ENV_RUN)
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits, name="plain")
        assert command_line(await actor.getpid()) == "asyncrl: plain"


def test_the_launcher_is_titled_by_its_script_and_then_by_the_run_it_names(tmp_path):
    script = tmp_path / "titled.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            from asyncrl.runtime import titles

            def cmdline():
                with open("/proc/self/cmdline", "rb") as f:
                    return " ".join(a.decode() for a in f.read().split(b"\\0") if a)

            def main():
                print(cmdline())
                titles.name_run("grpo-x")
                print(cmdline())
                print(os.environ[titles.ENV_RUN])
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != titles.ENV_RUN}
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["asyncrl: launch titled.py", "asyncrl: launch titled.py [grpo-x]", "grpo-x"]


def test_an_environment_that_does_not_fit_its_block_shows_asyncrls_own_variables_first():
    """`show_environ` in a forked child whose environment outgrew the block it was started with."""
    env = {"ASYNCRL_TEST_FIT": "1", "PATH": os.environ.get("PATH", "")}
    code = textwrap.dedent(
        f"""
        import os
        from asyncrl.runtime import titles
        env = {{"FILLER": "x" * 1_000_000, **{env!r}}}
        os.environ.clear()
        os.environ.update(env)
        print(titles.show_environ(env))
        with open("/proc/self/environ", "rb") as f:
            print(sorted(e.split(b"=", 1)[0].decode() for e in f.read().split(b"\\0") if e))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["False", "['ASYNCRL_TEST_FIT', 'PATH']"]  # FILLER left out whole
