"""``ActorHandle.kill``: the owner of an actor asks its supervisor to SIGKILL it (real processes).

A kill is a crash with a stated cause: the whole process group goes at once, pending calls fail
with ``ActorDiedError`` naming the cause, and the restart budget decides what follows. A kill
aimed at an incarnation that is already gone, or at an actor that is not running, does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from actors import Echo
from asyncrl import ActorDiedError, ActorState, Supervisor
from conftest import process_alive, wait_until


async def test_kill_of_a_running_actor_takes_its_children_and_restarts_it(caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl.supervisor")
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, name="victim", max_restarts=1)
        pid, child = await echo.getpid(), await echo.spawn_grandchild()
        first = echo.info()
        assert (first.state, first.incarnation, first.pid) == (ActorState.RUNNING, 1, pid)
        pending = asyncio.ensure_future(echo.sleep(60))
        await asyncio.sleep(0)  # one turn of the loop: the task sends the call, then waits for its reply
        start = time.monotonic()
        assert echo.kill("sampler judged frozen at step 7", incarnation=1) is True
        with pytest.raises(ActorDiedError, match=r"killed on request: sampler judged frozen at step 7"):
            await pending
        assert time.monotonic() - start < 2.0  # at once: no graceful stop is waited for
        back = await echo.wait_for_incarnation(1, timeout_s=30.0)
        assert (back.state, back.incarnation, back.restarts) == (ActorState.RUNNING, 2, 1)
        assert await echo.getpid() != pid
        assert await asyncio.to_thread(wait_until, lambda: not process_alive(pid) and not process_alive(child), 5.0)
        assert any(
            "killed on request: sampler judged frozen at step 7" in r.getMessage()
            and "restart 1 of 1" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]


async def test_kill_of_a_stale_incarnation_leaves_its_replacement_alone():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, max_restarts=2)
        assert echo.kill("first verdict") is True
        back = await echo.wait_for_incarnation(1, timeout_s=30.0)
        assert (back.state, back.incarnation) == (ActorState.RUNNING, 2)
        pid = await echo.getpid()
        assert echo.kill("a late verdict on incarnation 1", incarnation=1) is False
        assert await echo.add(1) == 2
        now = echo.info()
        assert (now.state, now.incarnation, now.restarts, now.pid) == (ActorState.RUNNING, 2, 1, pid)


async def test_kill_without_restarts_leaves_it_dead_with_the_reason_then_is_a_no_op():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo)
        assert echo.kill("no longer wanted") is True
        dead = await echo.wait_for_state({ActorState.DEAD}, timeout_s=10.0)
        assert dead.state is ActorState.DEAD and dead.pid is None
        assert "killed on request: no longer wanted" in dead.error
        assert echo.kill("again") is False
        assert echo.kill("again", incarnation=1) is False
        assert "killed on request: no longer wanted" in echo.info().error  # the cause is not overwritten
        with pytest.raises(ActorDiedError, match="no longer wanted"):
            await echo.add(1)


async def test_kill_of_a_restarting_or_stopped_actor_is_a_no_op():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, max_restarts=1)
        assert echo.kill("first") is True
        restarting = await echo.wait_for_state([ActorState.RESTARTING], timeout_s=10.0)
        # The replacement is only being started: there is nothing running to kill yet.
        assert restarting.state is ActorState.RESTARTING
        assert echo.kill("during the restart") is False
        back = await echo.wait_for_incarnation(1, timeout_s=30.0)
        assert (back.state, back.incarnation, back.restarts) == (ActorState.RUNNING, 2, 1)
        await sup.stop(echo)
        assert echo.kill("after the stop") is False
        assert echo.info().state is ActorState.STOPPED


async def test_wait_for_state_is_bounded_and_returns_at_once_on_a_final_state():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo)
        start = time.monotonic()
        status = await echo.wait_for_state(["restarting"], timeout_s=0.3)  # nothing happens: the deadline ends it
        assert status.state is ActorState.RUNNING
        assert 0.25 <= time.monotonic() - start < 2.0
        await sup.stop(echo)
        start = time.monotonic()
        status = await echo.wait_for_state([ActorState.RUNNING], timeout_s=30.0)  # STOPPED is never left
        assert status.state is ActorState.STOPPED and time.monotonic() - start < 0.1
        with pytest.raises(ValueError):
            await echo.wait_for_state([], timeout_s=1.0)


async def test_a_handle_pinned_to_an_incarnation_fails_once_it_is_gone_and_never_reaches_the_replacement():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, max_restarts=1)
        first = echo.pinned(1)
        assert await first.add(1) == 2
        pid = await first.getpid()
        os.kill(pid, signal.SIGKILL)
        restarting = await echo.wait_for_state([ActorState.RESTARTING], timeout_s=10.0)
        assert restarting.state is ActorState.RESTARTING
        start = time.monotonic()
        with pytest.raises(ActorDiedError, match="killed by SIGKILL"):  # no wait for the restart
            await first.with_timeout(30.0).add(1)
        assert time.monotonic() - start < 1.0
        back = await echo.wait_for_incarnation(1, timeout_s=30.0)
        assert back.incarnation == 2
        with pytest.raises(ActorDiedError, match="killed by SIGKILL"):
            await first.add(1)
        with pytest.raises(ActorDiedError, match="killed by SIGKILL"):
            async for _ in first.count(3):
                pass
        assert await echo.pinned(2).getpid() == back.pid != pid
        with pytest.raises(ActorDiedError, match="incarnation 3 is not the one running"):
            await echo.pinned(3).add(1)  # one that never ran


async def test_a_fleet_call_sent_after_its_incarnation_died_fails_as_that_death_not_on_the_replacement(monkeypatch):
    # The race CI met: the check before the calls saw the sampler running, it died before its call's
    # task started, and the call waited for the restart and reached a process that never joined.
    from asyncrl.rl.config.run import RecoveryConfig
    from asyncrl.rl.driver.fleet.membership import Membership, MemberState

    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, name="sampler0", max_restarts=1)
        members = Membership([echo], [0], recovery=RecoveryConfig(), log=lambda line: None)
        m = members.members[0]
        m.state, m.incarnation = MemberState.JOINED, 1
        os.kill(await echo.getpid(), signal.SIGKILL)
        await echo.wait_for_state([ActorState.RESTARTING], timeout_s=10.0)
        monkeypatch.setattr(members, "lose_replaced", lambda group: [])  # the death seen only after the check
        answers = await members.call_all([m], lambda h, _: h.add(1), timeout_s=30.0, what="a probe")
        assert isinstance(answers.results[0], ActorDiedError), answers.results  # the replacement would answer 2
        assert m.state is not MemberState.JOINED and members.faults[0].incarnation == 1
        assert members.faults[0].cause.startswith("died during a probe (killed by SIGKILL"), members.faults[0].cause
        back = await echo.wait_for_incarnation(1, timeout_s=30.0)
        assert back.incarnation == 2 and await echo.add(1) == 2
        await members.close()
