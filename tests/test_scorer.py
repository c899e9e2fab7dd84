"""The scorer actor: a teacher's log-probs of completion tokens, equal to one plain forward's;
requests waiting together scored in one pass; bad requests refused by type, the actor serving on;
the driver's `Teacher` retries a killed scorer on its restart and stops the run once it is gone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.rl.scorer.actor import ScorerActor, ScorerError
from asyncrl.rl.scorer.specs import TeacherSpec
from asyncrl.runtime import Supervisor
from sampler_support import ONE_THREAD, recomputed

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

pytest_plugins = ["sampler_support"]  # its fixtures: tiny_path, policy, prompts

COMPLETIONS = [[5, 9, 7], [4], [8, 8, 8, 8, 8, 6]]


async def test_waiting_requests_share_one_pass_and_match_a_plain_forward(tiny_path, policy, prompts):
    model = policy[0]
    scorer = ScorerActor(tiny_path, TeacherSpec(temperature=0.7))
    # six callers (six samplers' groups) queue before the worker runs: one pass takes them all
    calls = [asyncio.ensure_future(scorer.teacher_logprobs(prompts[i % 3], COMPLETIONS)) for i in range(6)]
    await asyncio.sleep(0)
    await scorer.on_start()
    try:
        results = await asyncio.wait_for(asyncio.gather(*calls), timeout=60)
        stats = await scorer.stats()
        assert (stats["requests"], stats["passes"]) == (6, 1), stats
        for i, result in enumerate(results):
            assert [len(r) for r in result] == [len(c) for c in COMPLETIONS]
            for lps, tokens in zip(result, COMPLETIONS):
                torch.testing.assert_close(
                    torch.tensor(lps), recomputed(model, prompts[i % 3], tokens, 0.7), atol=1e-5, rtol=0
                )
        # a token budget smaller than two requests: one pass each, the same numbers
        scorer.batch_tokens = 1
        again = [asyncio.ensure_future(scorer.teacher_logprobs(prompts[0], COMPLETIONS)) for _ in range(2)]
        for result in await asyncio.wait_for(asyncio.gather(*again), timeout=60):  # equal but for padding's rounding
            for lps, expected in zip(result, results[0]):
                torch.testing.assert_close(torch.tensor(lps), torch.tensor(expected), atol=1e-5, rtol=0)
        assert (await scorer.stats())["passes"] == 3
    finally:
        await scorer.on_stop()


async def test_the_actor_refuses_bad_requests_and_the_driver_retries_it_on_its_restart_until_gone(
    tiny_path, policy, prompts
):
    from asyncrl.rl.config.teacher import TeacherConfig
    from asyncrl.rl.driver.faults import RunStoppedError
    from asyncrl.rl.driver.teacher import ScorerLostError, Teacher
    from asyncrl.rl.rollout import RolloutGroup

    group = RolloutGroup(7, prompts[0], COMPLETIONS, [[0.0] * len(c) for c in COMPLETIONS], [0.0] * 3, version=0)
    lines = []
    async with Supervisor(call_timeout_s=60) as sup:
        handle = await sup.spawn(ScorerActor, tiny_path, name="scorer", env=ONE_THREAD, max_restarts=1)
        # bad requests: refused by type across the process boundary, and the actor serves on
        vocab = policy[0].get_output_embeddings().weight.shape[0]
        with pytest.raises(ScorerError, match=f"token id {vocab} is outside the teacher's vocabulary of {vocab}"):
            await handle.teacher_logprobs(prompts[0], [[1, vocab]])
        with pytest.raises(ScorerError, match="empty prompt"):
            await handle.teacher_logprobs([], [[1]])
        (lps,) = await handle.teacher_logprobs(prompts[1], [COMPLETIONS[2]])
        torch.testing.assert_close(
            torch.tensor(lps), recomputed(policy[0], prompts[1], COMPLETIONS[2], 1.0), atol=1e-5, rtol=0
        )
        stats = await handle.stats()
        assert stats["requests"] == 1 and stats["tokens"] == len(prompts[1]) + 6 and stats["score_s"] > 0

        teacher = Teacher(handle, TeacherConfig(timeout_s=60), restart_timeout_s=120, log=lines.append)
        assert handle.kill("test: lost mid-run")
        scored = await teacher.annotate(group)  # waits for the restart, then scores
        assert handle.info().incarnation == 2 and lines and "scorer (incarnation 1) lost" in lines[0]
        for lps, tokens in zip(scored.teacher_logprobs, COMPLETIONS):
            torch.testing.assert_close(
                torch.tensor(lps), recomputed(policy[0], prompts[0], tokens, 1.0), atol=1e-5, rtol=0
            )
        with pytest.raises(
            RunStoppedError, match="the scorer failed on the group of prompt 7: ScorerError: .*vocabulary"
        ):
            await teacher.annotate(RolloutGroup(7, prompts[0], [[vocab]], [[0.0]], [0.0], version=0))
        assert handle.kill("test: lost again, no restart left")
        with pytest.raises(
            ScorerLostError, match=r"the scorer (did not come back after incarnation 2|is not running) "
        ):
            await teacher.annotate(group)
