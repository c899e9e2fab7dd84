"""The held-out evaluation on Hugging Face samplers, for real, in actor processes (the shards,
losses and versions with stand-ins are test_heldout_parts.py's; vLLM's is in test_vllm_actor.py).

* Two HF samplers solve the held-out problems of version 0 with exactly the trainer's greedy
  result: the same solve rate and the same sums of the task's metrics. Exact, not close, on this
  CPU: both decode greedily in fp32 from the same weights, the trainer through ``model.generate``,
  the sampler through its own loop (`HFBackend`), and on these 24 problems (and 200 more, checked
  when this was written, in parts of 64 and of 16 rows) every completion is the same token for
  token. The HF backend runs one batch at a time, so rollouts asked meanwhile wait their turn on
  the same model, and are not counted with the evaluation's.
* A run with ``--run.eval_on samplers`` evaluates on its samplers the version each step left them:
  an evaluated step syncs whatever ``--run.sync_every`` (else the samplers would be lost for
  holding another version, and the trainer would do it), and its record says how long it took.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl import Supervisor
from asyncrl.rl.config.run import DataConfig, RecoveryConfig, RunConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.driver import heldout
from asyncrl.rl.driver.fleet.membership import Membership, MemberState
from asyncrl.rl.model.tally import HeldoutAsk, heldout_answer
from asyncrl.rl.sampler.actor import SamplerActor
from asyncrl.rl.tasks.loading import TaskSpec
from sampler_support import ONE_THREAD

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("actor_zygote")]
N = 24


class NotAsked:
    """The trainer, which the samplers leave nothing to."""

    name = "trainer"

    def with_timeout(self, timeout_s: float) -> NotAsked:
        return self

    async def evaluate_heldout(self, *args, **kwargs):
        raise AssertionError(f"the trainer was asked {args}")


def joined(handles: list) -> Membership:
    members = Membership(handles, list(range(len(handles))), recovery=RecoveryConfig(), log=print)
    for m, h in zip(members.members, handles):  # as after the start: in the group, with its weights (v0)
        m.state, m.incarnation = MemberState.JOINED, h.info().incarnation
    return members


async def test_hf_samplers_give_the_trainer_s_greedy_evaluation_exactly(model_path):
    import torch

    from asyncrl.rl.model.policy import load_policy
    from asyncrl.rl.trainer.heldout import HeldoutEvaluation

    data = DataConfig(n_train=50, n_heldout=N)
    model, tok, fmt = load_policy(model_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: see tests/test_sampler.py
    trainer = HeldoutEvaluation(TaskSpec("countdown"), data)  # the trainer's code, in this process
    try:
        parts = await asyncio.to_thread(  # blocking, as the trainer runs it: on a thread
            lambda: trainer(
                model, tok, fmt, HeldoutAsk(samples=2, rows=heldout.EVAL_ROWS), temperature=1.0, compiled=False
            )
        )
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    want = heldout_answer(parts, 2)

    run = RunConfig(eval_samples=2, eval_on="samplers", data=data)
    config = SamplerConfig(group_size=2, prompts_per_batch=2, backend="hf")
    logs: list[str] = []
    async with Supervisor(call_timeout_s=120) as sup:
        handles = await asyncio.gather(
            *(
                sup.spawn(
                    SamplerActor,
                    model_path,
                    config,
                    name=f"sampler{i}",
                    kwargs={"data": data, "seed": i},
                    env=ONE_THREAD,
                )
                for i in range(2)
            )
        )
        members = joined(list(handles))
        rollouts = asyncio.ensure_future(_collect(handles[0].rollouts(4)))  # beside the evaluation, same model
        found = await heldout.evaluate(NotAsked(), run, logs.append, version=0, members=members)
        groups = await asyncio.wait_for(rollouts, 120)
        stats = await handles[0].stats()
    assert found.rates["greedy"] == want["greedy"]
    metrics = {k: v for k, v in found.extra.items() if k.startswith("heldout/task/")}
    assert metrics == {f"heldout/{k}": v for k, v in want.items() if k.startswith("task/")} and metrics
    assert 0.0 <= found.rates["sampled"] <= 1.0
    assert len(groups) == 4 and all(g.version == 0 for g in groups)
    assert stats.groups == 4 and stats.completions == 8, stats  # the evaluation's are not rollouts
    assert logs[-1].startswith("held-out evaluation of v0: 24 problems greedy and 24 x 2 sampled in ")
    assert logs[-1].endswith(" on sampler0, sampler1") and all(m.in_group for m in members.members)


async def _collect(stream) -> list:
    return [g async for g in stream]


@pytest.mark.e2e
async def test_a_run_evaluates_on_its_samplers_the_version_each_step_left_them(model_path, tmp_path):
    from asyncrl.rl.driver.run import train
    from test_run_lifecycle import records, tiny

    run_dir, logs = tmp_path / "run", []
    overrides = ["--run.steps", "3", "--run.eval_every", "1", "--run.eval_samples", "1"]
    overrides += ["--run.eval_on", "samplers", "--run.sync_every", "2", "--sampler.count", "2"]
    async with Supervisor() as sup:
        summary = await train(tiny(model_path, run_dir, *overrides), sup, log=logs.append)
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    # --run.sync_every 2, yet every step synced: each was evaluated, on the samplers
    assert all(r["sync_s"] > 0 and r["eval_s"] > 0 for r in recs), recs
    assert not any(r["sampler_losses"] for r in recs) and summary["heldout_after"] == {
        "greedy": recs[-1]["heldout_solve_rate"],
        "sampled": recs[-1]["heldout_sampled_solve_rate"],
    }
    assert "held-out evaluations on the samplers (--run.eval_on samplers)" in logs
    for version in range(4):
        assert any(
            line.startswith(f"held-out evaluation of v{version}: 8 problems greedy and 8 x 1 sampled in ")
            and line.endswith(" on sampler0, sampler1")
            for line in logs
        ), logs
