"""A starting actor that reports progress is not a hang: `start_phase` moves the start deadline,
a start without reports still fails at ``start_timeout_s``, a phase that overruns its budget
fails naming it, and a process frozen during its start fails on its heartbeats' silence."""

from __future__ import annotations

import time

import pytest

from actors import FreezesInStart, PhasedStart
from asyncrl import ActorStartError, Supervisor, start_phase
from asyncrl.runtime import startup
from conftest import new_descendants

pytestmark = pytest.mark.timeout(60)


def test_start_phase_outside_an_actor_does_nothing_and_checks_its_arguments():
    start_phase("loading", budget_s=10)  # no worker here: nothing to tell, nothing raised
    with pytest.raises(ValueError, match="phase"):
        start_phase("  ")
    with pytest.raises(ValueError, match="budget_s"):
        start_phase("loading", budget_s=-1)
    with pytest.raises(ValueError, match="budget_s"):
        start_phase("loading", budget_s=float("inf"))


def test_a_report_goes_to_the_installed_reporter_until_it_is_removed():
    got = []
    startup.install(lambda *a: got.append(a))
    try:
        start_phase(" loading ", budget_s=5, knob="--x")
    finally:
        startup.install(None)
    start_phase("after")
    assert got == [("loading", 5.0, "--x")]


@pytest.mark.parametrize("from_thread", [False, True])
async def test_a_phase_with_a_budget_lets_a_start_outlast_start_timeout_s(from_thread):
    async with Supervisor(start_timeout_s=1.5) as sup:
        actor = await sup.spawn(PhasedStart, 3.0, 10.0, from_thread, name="slow")
        assert await actor.getpid() > 0


async def test_without_a_phase_the_same_start_fails_at_start_timeout_s_in_one_line():
    async with Supervisor(start_timeout_s=1.5) as sup:
        start = time.monotonic()
        with pytest.raises(ActorStartError) as info:
            await sup.spawn(PhasedStart, 3.0, name="slow")
        assert time.monotonic() - start < 3.0
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("actor 'slow': not ready within start_timeout_s=1.5")
        assert "--start_timeout_s" in message
        assert not new_descendants()


async def test_a_phase_that_overruns_its_budget_fails_naming_it_and_its_knob():
    async with Supervisor(start_timeout_s=1.0) as sup:
        start = time.monotonic()
        with pytest.raises(ActorStartError) as info:
            await sup.spawn(PhasedStart, 30.0, 2.0, name="loader")
        # Never before the phase's 2 s budget; long before its 30 s of work. The process's own start
        # (an interpreter and its imports) comes first and takes seconds on a loaded machine, so the
        # upper bound is the phase's work, not the budget plus a guess at that start.
        assert 1.9 < time.monotonic() - start < 15.0
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("actor 'loader': not ready: still 'loading the model' after 2 s (its budget 2 s)")
        assert "--test.load_timeout_s" in message and "--start_timeout_s" in message
        assert not new_descendants()


async def test_a_process_frozen_in_its_start_fails_on_its_heartbeats_before_the_deadline():
    async with Supervisor(
        start_timeout_s=30, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, term_timeout_s=0.5
    ) as sup:
        start = time.monotonic()
        with pytest.raises(ActorStartError, match=r"not ready: no heartbeat for 1\.\d s while 'about to freeze'"):
            await sup.spawn(FreezesInStart, name="frozen")
        assert time.monotonic() - start < 10.0
        assert not new_descendants()
