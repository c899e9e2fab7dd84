"""Supervision with real processes: death, restarts, start failures, devices, logs, groups."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from actors import Echo, ExitsInInit, FailsInInit, PhasedStart, SlowStart
from asyncrl import (
    ActorDiedError,
    ActorStartError,
    InvalidArgumentsError,
    NoFreeDevicesError,
    Supervisor,
    SupervisorClosedError,
)
from asyncrl.errors import ActorNotReadyError
from asyncrl.runtime.config import SupervisorConfig
from conftest import new_descendants, process_alive, wait_until


async def test_sigkill_mid_call_fails_fast_then_restart_serves():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, max_restarts=1)
        pid = await echo.getpid()
        pending = asyncio.ensure_future(echo.sleep(60))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ActorDiedError, match="killed by SIGKILL"):
            await pending
        assert time.monotonic() - start < 2.0
        assert await echo.add(1) == 2  # waits for the restart, then runs on the new process
        assert await echo.getpid() != pid
        info = echo.info()
        assert (info.state, info.restarts, info.incarnation) == ("running", 1, 2)


async def test_without_restarts_a_dead_actor_fails_every_call_at_once():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo)
        os.kill(await echo.getpid(), signal.SIGKILL)
        assert await asyncio.to_thread(wait_until, lambda: echo.info().state == "dead", 2.0)
        start = time.monotonic()
        with pytest.raises(ActorDiedError, match="killed by SIGKILL"):
            await echo.add(1)
        assert time.monotonic() - start < 0.1
        assert sup.status()[0].error is not None


async def test_restart_budget_is_spent_then_dead():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, max_restarts=2)
        for expected in (1, 2):
            os.kill(await echo.getpid(), signal.SIGKILL)
            # a call sent before the death is seen fails (it may have reached the dying process);
            # once the supervisor has seen it, calls wait for the restart
            assert await asyncio.to_thread(wait_until, lambda e=expected: echo.info().incarnation == e + 1, 2.0)
            assert await echo.add(0) == 1
            assert echo.info().restarts == expected
        os.kill(await echo.getpid(), signal.SIGKILL)
        with pytest.raises(ActorDiedError):
            while True:  # calls fail once the death is seen; bounded by the call timeout
                await echo.with_timeout(5).add(0)
                await asyncio.sleep(0.01)
        assert echo.info().state == "dead"


async def test_constructor_failure_raises_with_remote_traceback_and_leaves_nothing():
    async with Supervisor() as sup:
        with pytest.raises(ActorStartError, match="constructor refuses: nope") as info:
            await sup.spawn(FailsInInit, "nope", name="broken")
        assert "actors.py" in info.value.remote_traceback and "RuntimeError" in info.value.remote_traceback
        assert not new_descendants()
        assert sup.status() == []
        with pytest.raises(ActorStartError, match="exited with code 7 during start"):
            await sup.spawn(ExitsInInit)
        with pytest.raises(TypeError, match="missing a required argument"):
            await sup.spawn(FailsInInit)  # wrong arity is refused before any process starts
        echo = await sup.spawn(Echo, name="broken")  # the name is free again
        assert await echo.add(1) == 2


async def test_start_timeout_kills_the_slow_actor():
    async with Supervisor(start_timeout_s=1.0) as sup:
        start = time.monotonic()
        with pytest.raises(ActorStartError, match="not ready within start_timeout_s=1"):
            await sup.spawn(SlowStart)
        assert time.monotonic() - start < 5.0
        assert not new_descendants()


async def test_frozen_actor_is_detected_by_heartbeat_and_restarted():
    async with Supervisor(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0) as sup:
        echo = await sup.spawn(Echo, max_restarts=1)
        pid = await echo.getpid()
        pending = asyncio.ensure_future(echo.add(1))
        await asyncio.sleep(0)
        os.kill(pid, signal.SIGSTOP)
        # the reply to `pending` may or may not have been sent before the freeze
        call = asyncio.ensure_future(echo.with_timeout(10).sleep(0.01))
        start = time.monotonic()
        try:
            await call
        except ActorDiedError as e:
            assert "no heartbeat" in str(e)
        assert time.monotonic() - start < 5.0
        await asyncio.gather(pending, return_exceptions=True)
        assert wait_until(lambda: not process_alive(pid), 1.0)
        assert await echo.getpid() != pid


async def test_a_blocking_endpoint_is_not_mistaken_for_death():
    async with Supervisor(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0) as sup:
        echo = await sup.spawn(Echo)
        await echo.block(2.5)  # holds the actor's loop 2.5 times the heartbeat timeout
        assert await echo.add(1) == 2
        assert echo.info().restarts == 0


async def test_stop_kills_grandchildren_and_frees_the_name():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, name="parent")
        grandchild = await echo.spawn_grandchild()
        assert process_alive(grandchild)
        await sup.stop(echo)
        assert wait_until(lambda: not process_alive(grandchild), 1.0)  # SIGKILL lands asynchronously
        with pytest.raises(ActorDiedError, match="stopped"):
            await echo.add(1)
        assert echo.info().state == "stopped"


async def test_close_stops_everything_and_calls_fail():
    sup = Supervisor()
    await sup.start()
    group = await sup.spawn_group(Echo, 3, name="worker")
    assert [h.name for h in group] == ["worker-0", "worker-1", "worker-2"]
    grandchild = await group[0].spawn_grandchild()
    pending = asyncio.ensure_future(group[1].sleep(60))
    await asyncio.sleep(0.1)
    run_dir = sup._resources.run_dir
    assert os.path.isdir(run_dir)
    await sup.close()
    with pytest.raises(ActorDiedError):
        await pending
    assert wait_until(lambda: not new_descendants() and not process_alive(grandchild), 1.0)
    assert not os.path.exists(run_dir)
    with pytest.raises(SupervisorClosedError, match=r"^supervisor is closed; use it inside `async with"):
        await sup.spawn(Echo)
    await sup.close()  # idempotent
    with pytest.raises(SupervisorClosedError, match="^supervisor already closed$"):
        await sup.start()


async def test_spawn_group_failure_stops_the_started_ones():
    async with Supervisor() as sup:
        with pytest.raises(ActorStartError):
            await sup.spawn_group(FailsInInit, 2, "x")
        assert not new_descendants()


async def test_devices_are_assigned_and_hidden(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    async with Supervisor(device_kind="cuda") as sup:
        a = await sup.spawn(Echo, gpus=2)
        assert await a.env("CUDA_VISIBLE_DEVICES") == "3,5"
        cpu = await sup.spawn(Echo)
        assert await cpu.env("CUDA_VISIBLE_DEVICES") == ""
        with pytest.raises(NoFreeDevicesError, match="asks for 2 device.*1 of 3"):
            await sup.spawn(Echo, gpus=2)
        with pytest.raises(TypeError, match="module level"):
            await sup.spawn(_local_actor_class(), gpus=1)  # refused before any device is taken
        await sup.stop(a)
        b = await sup.spawn(Echo, gpus=3)
        assert sorted((await b.env("CUDA_VISIBLE_DEVICES")).split(",")) == ["3", "5", "7"]


async def test_colocated_actors_share_the_owners_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    async with Supervisor(device_kind="cuda") as sup:
        owner = await sup.spawn(Echo, name="owner", gpus=1)
        guest = await sup.spawn(Echo, name="guest", share_devices_with="owner", max_restarts=1)
        assert await guest.env("CUDA_VISIBLE_DEVICES") == "3" == await owner.env("CUDA_VISIBLE_DEVICES")
        with pytest.raises(NoFreeDevicesError, match="0 of 1"):
            await sup.spawn(Echo, gpus=1)  # shared, not a second device
        with pytest.raises(ValueError, match="neither gpus= nor another node"):
            await sup.spawn(Echo, gpus=1, share_devices_with="owner")
        with pytest.raises(ValueError, match="'nobody', which is not running"):
            await sup.spawn(Echo, share_devices_with="nobody")
        await sup.spawn(Echo, name="cpu")
        with pytest.raises(ValueError, match="'cpu', which has none"):
            await sup.spawn(Echo, share_devices_with="cpu")
        await sup.stop(guest)  # a guest gives nothing back: the owner still holds the device
        with pytest.raises(NoFreeDevicesError):
            await sup.spawn(Echo, gpus=1)
        await sup.stop(owner)
        assert await (await sup.spawn(Echo, gpus=1)).env("CUDA_VISIBLE_DEVICES") == "3"


def _local_actor_class():
    class Local(Echo):
        pass

    return Local


async def test_env_and_logs_reach_the_actor_and_back(capfd):
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, name="talker", env={"MY_SETTING": 42})
        assert await echo.env("MY_SETTING") == "42"
        await echo.say("hello from the actor\nsecond line")
    # closing drains the log pumps, so everything the actor printed has arrived by now
    out = capfd.readouterr().out
    assert "[talker]: hello from the actor\n[talker]: second line\n" in out


async def test_an_actor_s_loop_watch_names_what_holds_its_loop_when_asked_for(capfd):
    """``ASYNCRL_ACTOR_LOOP_WATCH_S`` (a diagnostic, off unless set): a ready actor whose loop is
    held past it says so on its stderr, naming the call, and again when the loop runs."""
    async with Supervisor() as sup:
        watched = await sup.spawn(Echo, name="watched", env={"ASYNCRL_ACTOR_LOOP_WATCH_S": "0.3"})
        plain = await sup.spawn(Echo, name="plain")
        await asyncio.gather(watched.block(1.2), plain.block(1.2))
        with pytest.raises(ActorStartError, match="ASYNCRL_ACTOR_LOOP_WATCH_S must be a number of seconds > 0"):
            await sup.spawn(Echo, name="misset", env={"ASYNCRL_ACTOR_LOOP_WATCH_S": "soon"})
    err = capfd.readouterr().err
    assert "[watched]: the event loop of actor 'watched' is blocked: no callback has run for" in err, err
    assert "block (tests/actors.py:121)" in err, err
    assert "[watched]: the event loop of actor 'watched' ran again after" in err, err
    assert "actor 'plain'" not in err, err


async def test_spawn_validates_its_arguments():
    async with Supervisor() as sup:
        with pytest.raises(ValueError, match="actor name"):
            await sup.spawn(Echo, name="bad name with spaces")
        with pytest.raises(TypeError, match="not a subclass of asyncrl.Actor"):
            await sup.spawn(dict)
        with pytest.raises(TypeError, match="cannot send"):
            await sup.spawn(Echo, object())
        with pytest.raises(ValueError, match="max_restarts"):
            await sup.spawn(Echo, max_restarts=-1)
        one = await sup.spawn(Echo, name="one")
        with pytest.raises(ValueError, match="already exists"):
            await sup.spawn(Echo, name="one")
        await sup.stop(one)
        assert await (await sup.spawn(Echo, 1, name="one")).add(1) == 3  # a stopped actor's name is free
        with pytest.raises(ValueError, match="call_timeout_s"):
            await sup.spawn(Echo, call_timeout_s=0)
        with pytest.raises(InvalidArgumentsError, match=r"Echo.__init__\(\): Expected `int`, got `str` - at `offset`"):
            await sup.spawn(Echo, "ten")  # checked before a process is started
    with pytest.raises(SupervisorClosedError):
        await Supervisor().spawn(Echo)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"transport": "udp"}, "transport"),
        ({"call_timeout_s": 0}, "call_timeout_s"),
        ({"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.5}, "heartbeat_timeout_s"),
        ({"max_message_bytes": 10}, "max_message_bytes"),
        ({"device_kind": "tpu"}, "device_kind"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SupervisorConfig(**kwargs)


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("ASYNCRL_SUP_CALL_TIMEOUT_S", "12.5")
    monkeypatch.setenv("ASYNCRL_SUP_TRANSPORT", "tcp")
    monkeypatch.setenv("ASYNCRL_SUP_HANDLE_SIGNALS", "false")
    cfg = SupervisorConfig.from_env(stop_timeout_s=3.0)
    assert (cfg.call_timeout_s, cfg.transport, cfg.handle_signals, cfg.stop_timeout_s) == (12.5, "tcp", False, 3.0)
    monkeypatch.setenv("ASYNCRL_SUP_CALL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="ASYNCRL_SUP_CALL_TIMEOUT_S='soon'"):
        SupervisorConfig.from_env()


async def test_tcp_transport_works():
    async with Supervisor(transport="tcp") as sup:
        echo = await sup.spawn(Echo)
        assert echo._record.client.address.startswith("tcp://127.0.0.1:")
        assert await echo.add(2) == 3


async def test_cancelled_spawn_leaves_no_process():
    async with Supervisor() as sup:
        task = asyncio.ensure_future(sup.spawn(SlowStart))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(wait_until, lambda: not new_descendants(), 2.0)
        assert sup.status() == []


async def test_supervisor_that_cannot_bind_tears_down_what_it_built():
    import tempfile

    mine = f"asyncrl-{os.getpid()}-"
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)}
    sup = Supervisor(transport="tcp", host="192.0.2.1")  # TEST-NET-1: never an address of this host
    with pytest.raises(OSError, match="cannot bind"):
        await sup.start()
    after = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)}
    assert after <= before
    with pytest.raises(SupervisorClosedError):
        await sup.spawn(Echo)


async def test_an_actor_imports_with_the_drivers_path_in_the_drivers_order(tmp_path, monkeypatch):
    # setuptools appends its vendored packages last in a driver that imports it; an actor that put
    # such entries first let an old typing_extensions shadow the installed one.
    first, last = str(tmp_path / "first"), str(tmp_path / "last")
    monkeypatch.setattr("sys.path", [first, *sys.path, last])
    async with Supervisor() as sup:
        path = await (await sup.spawn(Echo, name="e")).sys_path()
    site = next(i for i, p in enumerate(path) if p.endswith("site-packages"))
    assert path.index(first) < site < path.index(last), path


async def kill_while_starting(sup, name: str, incarnations: set[int], timeout_s: float = 60.0) -> list[int]:
    """SIGKILL the process of each of ``name``'s ``incarnations`` as soon as it exists, while it is
    still starting (tests only: watching the supervisor's status from the spawn's own loop)."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while set(killed) != incarnations:
        assert time.monotonic() < deadline, f"not all of {incarnations} of {name} seen starting: {sup.status()}"
        for s in sup.status():
            if s.name == name and s.state == "starting" and s.pid and s.incarnation in incarnations - set(killed):
                os.kill(s.pid, signal.SIGKILL)
                killed.append(s.incarnation)
        await asyncio.sleep(0.005)
    return killed


async def test_a_start_killed_is_retried_within_max_restarts_which_later_restarts_share():
    async with Supervisor() as sup:
        killer = asyncio.ensure_future(kill_while_starting(sup, "slow", {1, 2}))
        slow = await sup.spawn(PhasedStart, 2.0, name="slow", max_restarts=2)  # 2 s in its constructor
        assert await killer == [1, 2]
        info = slow.info()
        assert (info.state, info.incarnation, info.restarts, info.error) == ("running", 3, 2, None)
        pid = await slow.getpid()
        os.kill(pid, signal.SIGKILL)  # the budget is spent: a death now is the end of it
        assert await asyncio.to_thread(wait_until, lambda: slow.info().state == "dead", 5.0)


async def test_a_start_lost_for_good_raises_or_with_keep_if_lost_leaves_a_dead_actor():
    async with Supervisor() as sup:
        killer = asyncio.ensure_future(kill_while_starting(sup, "lost", {1, 2}))
        with pytest.raises(ActorNotReadyError, match=r"^actor 'lost': process killed by SIGKILL during start$"):
            await sup.spawn(PhasedStart, 2.0, name="lost", max_restarts=1)
        await killer
        assert sup.status() == [] and not new_descendants()

        killer = asyncio.ensure_future(kill_while_starting(sup, "kept", {1}))
        kept = await sup.spawn(PhasedStart, 2.0, name="kept", keep_if_lost=True)
        await killer
        (status,) = sup.status()
        assert (status.name, status.state, status.restarts, status.pid) == ("kept", "dead", 0, None)
        assert "killed by SIGKILL during start" in status.error
        start = time.monotonic()
        with pytest.raises(ActorNotReadyError, match="killed by SIGKILL during start"):
            await kept.getpid()  # fails at once, with the start's error
        assert time.monotonic() - start < 0.5 and not new_descendants()
        again = await sup.spawn(Echo, name="kept")  # a dead actor's name is free again
        assert await again.add(1) == 2


async def test_a_start_its_constructor_refused_is_not_retried_nor_kept(caplog):
    async with Supervisor() as sup:
        with caplog.at_level("WARNING", logger="asyncrl.supervisor"):
            with pytest.raises(ActorStartError, match="constructor refuses: nope"):
                await sup.spawn(FailsInInit, "nope", name="broken", max_restarts=3, keep_if_lost=True)
        assert sup.status() == [] and not new_descendants()
        assert not [r for r in caplog.records if "lost during its start" in r.getMessage()]


async def test_an_actors_process_is_started_off_the_event_loop(monkeypatch):
    """Starting a process (``Popen``: fork and exec) takes a fraction of a second, seconds on a
    loaded host; on the event loop it froze every deadline meanwhile. Seen: ``asyncrl scale
    --samplers 99`` blocked the driver's loop 25 s in ``Popen``. Here ``Popen`` returns only once
    the loop has run a callback scheduled after the spawn began."""
    import subprocess
    import threading

    from asyncrl.runtime import process

    loop_ran, real_popen = threading.Event(), subprocess.Popen

    def popen(*args, **kwargs):
        assert loop_ran.wait(30), "the event loop did not run while the process was started"
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    async with Supervisor() as sup:
        spawning = asyncio.ensure_future(sup.spawn(Echo, name="echo"))
        await asyncio.sleep(0)  # the spawn is under way
        asyncio.get_running_loop().call_soon(loop_ran.set)
        echo = await spawning
        assert await echo.getpid() != os.getpid()
