"""Pacing (rl/driver/pacing.py) with the real RolloutQueue: producers that ask the `Pacer` for
credit before each batch never make a group the trainer drops, and the queue stays bounded; the
same producers unpaced lose groups to staleness (so the test can tell the difference). What takes
time (making, training, a timeout) runs on a virtual clock (virtual_time.py): no wall time waited,
and no late timer of a loaded machine changes the order of events."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.rl.driver.pacing import Pacer, PacingTimeoutError
from asyncrl.rl.driver.queue import RolloutQueue
from asyncrl.rl.rollout import RolloutGroup
from virtual_time import run_virtual


def group(version: int, i: int) -> RolloutGroup:
    return RolloutGroup(
        prompt_id=i,
        prompt_ids=[1, 2],
        completion_ids=[[3], [4]],
        behaviour_logprobs=[[-0.5], [-0.7]],
        rewards=[0.0, 1.0],
        version=version,
        sampler="s",
    )


async def simulate(
    *,
    paced: bool,
    max_staleness: int,
    steps: int = 30,
    n: int = 8,
    batch: int = 4,
    producers: int = 1,
    make_s: float = 0.002,
    train_s: float = 0.02,
) -> tuple[RolloutQueue, int]:
    """A driver loop (take a batch, train, sync) and producers that make ``batch`` groups at a
    time, much faster than the trainer: the case where unpaced sampling is thrown away."""
    queue = RolloutQueue(2 * n, max_staleness)
    pacer = Pacer(queue, n, max_staleness, version=0, next_step=1)
    sampler_version = [0]
    deepest = [0]

    async def produce(p: int) -> None:
        i = 0
        while True:
            credit = await pacer.acquire(batch, 10.0, f"producer{p}") if paced else batch
            version = sampler_version[0]  # read when the batch begins, as the sampler does
            await asyncio.sleep(make_s * credit)
            for _ in range(credit):
                await queue.put(group(version, i), timeout_s=10.0)
                i += 1
                deepest[0] = max(deepest[0], len(queue))
                if paced:
                    pacer.delivered()

    tasks = [asyncio.ensure_future(produce(p)) for p in range(producers)]
    try:
        for step in range(1, steps + 1):
            batch_groups = await queue.get_batch(n, current_version=step - 1, timeout_s=10.0)
            assert all(step - 1 - g.version <= max_staleness for g in batch_groups)
            pacer.batch_taken(step - 1)
            await asyncio.sleep(train_s)
            sampler_version[0] = step  # the sync: every sampler holds the new weights
            pacer.synced(step)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return queue, deepest[0]


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_paced_producers_make_nothing_that_is_dropped_and_the_queue_stays_bounded(max_staleness):
    queue, deepest = run_virtual(simulate(paced=True, max_staleness=max_staleness))
    stats = queue.stats()
    assert stats.dropped_stale == 0 and stats.batches == 30
    assert deepest <= 8 * (max_staleness + 1)  # never more than the steps that can still train them


def test_unpaced_producers_lose_groups_to_staleness():
    queue, _ = run_virtual(simulate(paced=False, max_staleness=1))
    assert queue.stats().dropped_stale > 30  # the waste pacing removes


def test_two_paced_producers_drop_almost_nothing():
    queue, _ = run_virtual(simulate(paced=True, max_staleness=1, producers=2))
    stats = queue.stats()
    assert stats.dropped_stale <= stats.gets // 20, stats  # under 5% of what was trained


async def test_room_follows_versions_steps_and_what_is_queued():
    queue = RolloutQueue(32, 1)
    pacer = Pacer(queue, 16, 1, version=0, next_step=1)
    assert pacer.room() == 32  # steps 1 and 2 can train a group begun at version 0
    assert await pacer.acquire(8, 1.0, "s") == 8 and pacer.room() == 24
    pacer.batch_taken(0)  # step 1 took its batch; the sampler still holds version 0
    assert pacer.room() == 16 - 8
    pacer.synced(1)
    assert pacer.room() == 32 - 8
    pacer.give_back(8)
    assert pacer.room() == 32


async def test_the_pacer_counts_grants_in_flight_and_their_peaks_since_the_last_step():
    pacer = Pacer(RolloutQueue(32, 1), 16, 1, version=0, next_step=1)
    assert await pacer.acquire(8, 1.0, "s") == 8 and await pacer.acquire(8, 1.0, "s") == 8
    assert pacer.stats().paced_streams == 2 and pacer.stats().paced_in_flight == 16
    pacer.delivered()
    pacer.give_back(7)  # the first batch ended after one group
    assert pacer.take_peaks() == (2, 16)  # the step's most: two batches, 16 groups
    assert pacer.take_peaks() == (1, 8)  # the next step's start from what is in flight now


def test_a_pump_without_credit_times_out_naming_who_waited():
    queue = RolloutQueue(4, 0)
    pacer = Pacer(queue, 4, 0, version=0, next_step=2)  # the batch of step 1 is taken, no sync yet
    with pytest.raises(PacingTimeoutError, match="sampler3: no credit for 4 groups within 60 s"):
        run_virtual(pacer.acquire(8, 60.0, "sampler3"))
    assert pacer.in_flight == 0


async def test_a_queue_short_of_a_whole_batch_is_given_the_groups_it_lacks():
    # A lost sampler's half-made batch, or groups left out as uniform, leave 14 of 16 queued with
    # nothing being made: a pump holding out for a whole batch of 8 (room 2) would wait forever,
    # and no batch would ever be taken to make room.
    queue = RolloutQueue(32, 0)
    pacer = Pacer(queue, 16, 0, version=4, next_step=5)  # the driver waits for step 5's batch
    for i in range(14):
        await queue.put(group(4, i), timeout_s=1.0)
    assert pacer.room() == 2
    assert await pacer.acquire(8, 1.0, "sampler0") == 2 and pacer.in_flight == 2
    assert pacer.grant(8) == 0  # the batch is whole once those arrive: the next pump waits for room


async def test_a_pump_content_with_fewer_groups_gets_what_the_room_holds():
    # A vLLM sampler's pump asks for its window's room but takes what the pacer has (least=1):
    # held out for all of it, the groups that ended would stay unreplaced until the room grew.
    pacer = Pacer(RolloutQueue(32, 1), 16, 1, version=1, next_step=2)  # the driver waits for step 2's batch
    assert await pacer.acquire(16, 1.0, "s") == 16 and await pacer.acquire(13, 1.0, "s") == 13
    assert pacer.room() == 3 and pacer.short() < 0
    assert pacer.grant(8) == 0  # a whole batch of 8 waits for room (the next batch is not short)
    assert pacer.grant(8, least=1) == 3 and pacer.grant(2, least=1) == 2
    assert await pacer.acquire(8, 1.0, "s", least=1) == 3 and pacer.room() == 0
    assert pacer.grant(1, least=1) == 0


def test_a_pump_waiting_for_credit_wakes_when_stale_groups_are_dropped():
    # get_batch drops stale groups without a word to the pacer: the room they leave must still
    # wake a pump that waits for credit.
    queue = RolloutQueue(8, 0)
    pacer = Pacer(queue, 4, 0, version=1, next_step=2)

    async def main() -> None:
        for i in range(4):
            await queue.put(group(0, i), timeout_s=1.0)  # made at v0: too stale for step 2 (trains at v1)
        pump = asyncio.ensure_future(pacer.acquire(4, 60.0, "sampler0"))
        await asyncio.sleep(30.0)
        assert not pump.done()  # no room: the queue looks full
        batch = asyncio.ensure_future(queue.get_batch(4, current_version=1, timeout_s=60.0))  # drops all 4
        try:
            assert await asyncio.wait_for(pump, 1.0) == 4
        finally:
            batch.cancel()
            await asyncio.gather(batch, return_exceptions=True)

    run_virtual(main())
    assert queue.stats().dropped_stale == 4


def test_a_sync_interval_no_group_could_survive_is_refused():
    from asyncrl.rl.config.run import RunConfig

    with pytest.raises(ValueError, match="sync_every 3 needs max_staleness >= 2 in async mode"):
        RunConfig(sync_every=3, max_staleness=1)
    RunConfig(sync_every=2, max_staleness=1)


def test_max_staleness_auto_is_two_where_the_samplers_have_gpus_of_their_own():
    """None (auto): 1 on the CPU and colocated, 2 where the samplers have GPUs of their own, never
    below what ``sync_every`` needs; resolved for the host as the run starts, said in its log."""
    import dataclasses

    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.run import RunConfig
    from asyncrl.rl.driver.build import resolve_samplers
    from asyncrl.rl.driver.devices import plan_devices

    assert RunConfig().max_staleness is None
    assert (RunConfig().staleness_bound(), RunConfig().staleness_bound(samplers_apart=True)) == (1, 2)
    assert RunConfig(sync_every=4).staleness_bound() == 3 and RunConfig(max_staleness=5).staleness_bound(True) == 5
    for ids, expected in ((["0", "1"], 2), (["0"], 1)):
        lines: list[str] = []
        resolved = resolve_samplers(GRPOConfig(), plan_devices("auto", "cuda", ids, 0), lines.append)
        assert resolved.run.max_staleness == expected
        assert f"groups trained up to {expected} version(s) after their weights (--run.max_staleness auto)" in lines[0]
    asked = dataclasses.replace(GRPOConfig(), run=RunConfig(max_staleness=1))
    assert resolve_samplers(asked, plan_devices("auto", "cuda", ["0", "1"], 0), print).run.max_staleness == 1
    assert resolve_samplers(GRPOConfig(), plan_devices("auto", None, [], 0), print).run.max_staleness == 1


def test_max_staleness_auto_is_two_on_a_shared_gpu_at_long_completions():
    """Colocated on one GPU, completions that may run to LONG_COMPLETIONS tokens or more (the
    limit, or the lengths profile's cap where no limit is set) resolve auto to 2, and with it two
    paced batches; shorter ones, the CPU and an explicit bound stay as they were."""
    import dataclasses

    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.lengths import LONG_COMPLETIONS
    from asyncrl.rl.config.model import ModelConfig
    from asyncrl.rl.config.run import RunConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.driver.build import resolve_samplers
    from asyncrl.rl.driver.devices import plan_devices

    def resolved(device, ids, run=None, **sampler):
        model, run = ModelConfig(max_positions=16384), run or RunConfig()
        config = dataclasses.replace(GRPOConfig(), model=model, sampler=SamplerConfig(**sampler), run=run)
        lines: list[str] = []
        return resolve_samplers(config, plan_devices("auto", device, ids, 0), lines.append), lines[0]

    one_gpu = ("cuda", ["0"])
    config, line = resolved(*one_gpu, max_new_tokens=8192)
    assert (config.run.max_staleness, config.sampler.streams) == (2, 2)
    assert "up to 2 version(s) after their weights (--run.max_staleness auto: completions up to 8192 tokens)" in line
    assert resolved(*one_gpu, lengths=f"lognormal:{LONG_COMPLETIONS}")[0].run.max_staleness == 2
    config, line = resolved(*one_gpu, max_new_tokens=LONG_COMPLETIONS - 1)
    assert (config.run.max_staleness, config.sampler.streams) == (1, 1) and "completions up to" not in line
    assert resolved(*one_gpu, max_new_tokens=0)[0].run.max_staleness == 1  # the model's own limit: unknown here
    assert resolved(None, [], max_new_tokens=8192)[0].run.max_staleness == 1
    assert resolved(*one_gpu, run=RunConfig(max_staleness=1), max_new_tokens=8192)[0].run.max_staleness == 1
    config, line = resolved("cuda", ["0", "1"], max_new_tokens=8192)
    assert config.run.max_staleness == 2 and "completions up to" not in line  # 2 for the samplers' own GPUs


def test_engine_stats_auto_counts_preemptions_at_long_completions_only():
    """Where the KV cache fills (completions that may run to LONG_COMPLETIONS tokens), vLLM samplers
    count their engines' preemptions by default; shorter ones keep the sampler's CPU for decoding."""
    from asyncrl.rl.config.lengths import LONG_COMPLETIONS
    from asyncrl.rl.config.sampler import SamplerConfig

    assert SamplerConfig(max_new_tokens=LONG_COMPLETIONS).keeps_engine_stats
    assert SamplerConfig(lengths="lognormal:8192").keeps_engine_stats
    assert not SamplerConfig(max_new_tokens=LONG_COMPLETIONS - 1).keeps_engine_stats
    assert not SamplerConfig(max_new_tokens=0).keeps_engine_stats  # the model's own limit: unknown here
    assert not SamplerConfig(max_new_tokens=8192, engine_stats=False).keeps_engine_stats
    assert SamplerConfig(max_new_tokens=256, engine_stats=True).keeps_engine_stats


def scored(*rewards: float) -> RolloutGroup:
    n = len(rewards)
    return RolloutGroup(
        prompt_id=0,
        prompt_ids=[1],
        completion_ids=[[2]] * n,
        behaviour_logprobs=[[-0.5]] * n,
        rewards=list(rewards),
        version=0,
        sampler="s",
    )


def test_uniform_groups_are_left_out_up_to_a_batch_s_worth_between_batches():
    from asyncrl.rl.driver.uniform import UniformGroups

    uniform = UniformGroups(per_batch=2)
    assert not uniform.leave_out(scored(0.0, 1.0)) and not uniform.leave_out(scored(0.1, 0.0))  # a signal: trained
    assert uniform.leave_out(scored(0.0, 0.0)) and uniform.leave_out(scored(1.0, 1.0))
    assert not uniform.leave_out(scored(0.0, 0.0))  # the budget is spent: a task without signal still trains
    assert [g.rewards for g in uniform.take()] == [[0.0, 0.0], [1.0, 1.0]] and uniform.take() == []
    uniform.batch_taken()
    assert uniform.leave_out(scored(0.1, 0.1, 0.1)) and uniform.total == 3
    off = UniformGroups(per_batch=0)  # --run.skip_uniform_groups false
    assert not off.leave_out(scored(0.0, 0.0)) and off.total == 0
