"""The zygote (runtime/zygotes/zygote.py): actors forked from a process that imported their modules once.

Real processes: an actor forked by it serves calls, its exit code (a clean stop, ``sys.exit(3)``,
a SIGKILL) reaches the supervisor through the zygote's reports, a SIGKILLed supervisor leaves no
process (zygote, actors) behind, and a zygote that dies fails its actors with a clear error while
the next start goes through ``Popen``. A pool keeps zygotes between supervisors, one at a time each.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from actors import Echo, Exits
from asyncrl import ActorDiedError, ActorState, Supervisor
from asyncrl.runtime.config import ENV_PREFIX
from asyncrl.runtime.zygotes import zygote
from asyncrl.runtime.zygotes.pool import ZygotePool, active_pool
from conftest import process_alive, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def light_zygote(monkeypatch):
    """Only the worker preloaded (seconds less per test); the default list has a test of its own."""
    monkeypatch.setenv(ENV_PREFIX + "ZYGOTE_PRELOAD", "asyncrl.runtime.worker")
    monkeypatch.delenv(zygote.ENV_ZYGOTE, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no device visible: where the zygote is used


async def test_an_actor_forked_by_the_zygote_serves_and_stops_cleanly():
    async with Supervisor() as sup:
        assert sup._zygote is not None
        echo = await sup.spawn(Exits)
        pid = await echo.getpid()
        assert await echo.parent() == sup._zygote.pid  # forked by it, not by Popen
        assert os.getpgid(pid) == pid  # a session and group of its own
        other = await sup.spawn(Echo, name="second")
        assert await other.add(1) == 2
        zpid = sup._zygote.pid
    assert echo.info().state is ActorState.STOPPED
    assert not process_alive(pid) and not process_alive(zpid)


@pytest.mark.parametrize("code", [0, 3])
async def test_an_exit_code_reaches_the_supervisor_after_a_normal_shutdown(tmp_path, code):
    marker = str(tmp_path / "marker")
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits)
        await actor.exit_later(code, marker)
        dead = await actor.wait_for_state({ActorState.DEAD}, timeout_s=10.0)
        assert f"exited with code {code}" in dead.error
    assert open(marker).read() == "atexit"  # atexit ran: not an os._exit


async def test_a_sigkill_reaches_the_supervisor_and_the_actor_restarts_by_the_zygote():
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits, max_restarts=1)
        pid = await actor.getpid()
        pending = asyncio.ensure_future(actor.exit_later(0, "/nonexistent"))  # any call in flight
        await asyncio.sleep(0)
        os.kill(pid, signal.SIGKILL)
        try:
            await pending
        except ActorDiedError as e:
            assert "killed by SIGKILL" in str(e)
        back = await actor.wait_for_incarnation(1, timeout_s=30.0)
        assert back.state is ActorState.RUNNING and back.restarts == 1
        assert await actor.parent() == sup._zygote.pid
        assert await actor.getpid() != pid


async def test_a_sigkilled_actor_without_restarts_is_dead_with_the_signal():
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits)
        os.kill(await actor.getpid(), signal.SIGKILL)
        dead = await actor.wait_for_state({ActorState.DEAD}, timeout_s=10.0)
        assert "killed by SIGKILL" in dead.error


async def test_a_killed_zygote_fails_its_actors_clearly_and_the_next_start_uses_popen(caplog):
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits)
        pid, zpid = await actor.getpid(), sup._zygote.pid
        os.kill(zpid, signal.SIGKILL)
        dead = await actor.wait_for_state({ActorState.DEAD}, timeout_s=10.0)
        assert f"lost: the zygote (pid {zpid}) killed by SIGKILL" in dead.error, dead.error
        with pytest.raises(ActorDiedError, match="lost: the zygote"):
            await actor.getpid()
        assert await asyncio.to_thread(wait_until, lambda: not process_alive(pid), 5.0)
        after = await sup.spawn(Exits, name="after")
        assert await after.parent() == os.getpid()  # by Popen
        assert f"zygote pid {zpid} is gone" in caplog.text and "later actors start by Popen" in caplog.text


def test_a_sigkilled_supervisor_leaves_no_process(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, os, sys
            sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
            from actors import Exits
            from asyncrl import Supervisor

            async def main():
                async with Supervisor() as sup:
                    a = await sup.spawn(Exits)
                    b = await sup.spawn(Exits, name="b")
                    print(sup._zygote.pid, await a.getpid(), await b.getpid(), flush=True)
                    await asyncio.sleep(600)

            asyncio.run(main())
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 3 and all(process_alive(p) for p in pids), pids
    finally:
        driver.kill()
        driver.wait()
    assert wait_until(lambda: not any(process_alive(p) for p in pids), 10.0), [p for p in pids if process_alive(p)]


async def test_the_default_preload_forks_actors_with_torch_imported(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "ZYGOTE_PRELOAD", ",".join(zygote.PRELOAD))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits, env={"OMP_NUM_THREADS": "2"})
        assert await actor.parent() == sup._zygote.pid
        assert await actor.torch_threads() == 2  # set from the child's environment, not the zygote's
        assert sup._zygote.ready.result().failed == []


async def test_what_a_preloaded_module_read_from_the_environment_follows_the_actors(monkeypatch):
    """tqdm reads TQDM_* at import: in the zygote, before any actor's environment was known."""
    monkeypatch.setenv(ENV_PREFIX + "ZYGOTE_PRELOAD", "asyncrl.runtime.worker,tqdm.std")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    async with Supervisor() as sup:
        quiet = await sup.spawn(Exits, env={"TQDM_DISABLE": "1"})
        loud = await sup.spawn(Exits, name="loud")
        assert await quiet.parent() == sup._zygote.pid
        assert await quiet.tqdm_disabled() is True
        assert await loud.tqdm_disabled() is False


async def test_an_actor_s_temporary_directory_is_its_own_not_the_one_the_zygote_found(monkeypatch, tmp_path):
    """A preloaded import found the zygote's TMPDIR (a directory that may be gone by the time an
    actor is forked: an in-process vLLM engine's scratch, once); the actor gets its own."""
    for name in ("zygote", "actor"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv(ENV_PREFIX + "ZYGOTE_PRELOAD", "asyncrl.runtime.worker,tmpdir_at_import")
    tests = os.path.dirname(os.path.abspath(__file__))  # where the zygote finds that module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "zygote"))
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits, env={"TMPDIR": str(tmp_path / "actor")})
        assert await actor.parent() == sup._zygote.pid
        assert sup._zygote.ready.result().failed == []  # the zygote did import it
        assert await actor.temp_dir() == str(tmp_path / "actor")


async def test_an_actor_whose_environment_differs_in_what_imports_read_starts_by_popen(monkeypatch, caplog):
    caplog.set_level("INFO", logger="asyncrl.supervisor")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    async with Supervisor() as sup:
        offline = await sup.spawn(Exits, env={"HF_HUB_OFFLINE": "1"})
        assert await offline.parent() == os.getpid()
        assert "differs from the zygote's in HF_HUB_OFFLINE, read before a fork" in caplog.text
        same = await sup.spawn(Exits, name="same")
        assert await same.parent() == sup._zygote.pid


async def test_no_zygote_unless_asked_for(monkeypatch):
    monkeypatch.delenv(ENV_PREFIX + "ZYGOTE_PRELOAD")
    async with Supervisor() as sup:
        assert sup._zygote is None
        actor = await sup.spawn(Exits)
        assert await actor.parent() == os.getpid()


async def test_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(zygote.ENV_ZYGOTE, "0")
    async with Supervisor() as sup:
        assert sup._zygote is None
        actor = await sup.spawn(Exits)
        assert await actor.parent() == os.getpid()


# --- a pool: zygotes kept between supervisors (runtime/zygotes/pool.py) -----------------------------


async def _one_supervisor(code: int = 0) -> tuple[int, int]:
    """A supervisor whose actor is forked, serves, and exits with ``code`` (the zygote reports it):
    (the zygote's pid, the actor's)."""
    async with Supervisor() as sup:
        actor = await sup.spawn(Exits)
        zpid, pid = sup._zygote.pid, await actor.getpid()
        assert await actor.parent() == zpid
        await actor.exit_later(code, "/nonexistent")
        dead = await actor.wait_for_state({ActorState.DEAD}, timeout_s=10.0)
        assert f"exited with code {code}" in dead.error
    return zpid, pid


def test_supervisors_one_after_another_on_their_own_loops_fork_from_one_pooled_zygote():
    """Three supervisors, each on an event loop of its own (``asyncio.run``), fork their actors
    from the same zygote: each sees its own actor's exit code and none of the earlier ones'; their
    actors are gone when they close, the zygote is not; closing the pool ends it."""
    with ZygotePool() as pool:
        runs = [asyncio.run(_one_supervisor(code)) for code in (0, 3, 5)]
        [zpid] = {zpid for zpid, _ in runs}
        assert pool.pids == {zpid} and process_alive(zpid)
        assert not any(process_alive(pid) for _, pid in runs)
    assert wait_until(lambda: not process_alive(zpid), 5.0)
    assert active_pool() is None


async def test_a_pooled_zygote_is_not_shared_by_two_supervisors_at_once_nor_across_what_imports_read(monkeypatch):
    with ZygotePool() as pool:
        async with Supervisor() as a, Supervisor() as b:
            assert a._zygote.pid != b._zygote.pid
            pids = {a._zygote.pid, b._zygote.pid}
        async with Supervisor() as c:  # on the loop a and b were on
            assert c._zygote.pid in pids  # an idle one
            assert await (await c.spawn(Exits)).parent() == c._zygote.pid
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: a zygote of its own
        async with Supervisor() as d:
            assert d._zygote.pid not in pids
            actor = await d.spawn(Exits)
            assert await actor.parent() == d._zygote.pid
            pids.add(d._zygote.pid)
        assert len(pool.pids) == pool.max_idle == 2 and pool.pids < pids  # the oldest idle one ended
    assert wait_until(lambda: not any(process_alive(p) for p in pids), 5.0)


async def test_a_pooled_zygote_that_died_is_not_given_back(caplog):
    with ZygotePool() as pool:
        async with Supervisor() as sup:
            actor = await sup.spawn(Exits)
            zpid = sup._zygote.pid
            os.kill(zpid, signal.SIGKILL)
            dead = await actor.wait_for_state({ActorState.DEAD}, timeout_s=10.0)
            assert f"lost: the zygote (pid {zpid}) killed by SIGKILL" in dead.error, dead.error
        assert pool.pids == set()
        async with Supervisor() as sup:
            assert sup._zygote.pid != zpid
            assert await (await sup.spawn(Exits)).parent() == sup._zygote.pid
