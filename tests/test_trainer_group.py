"""An N-rank trainer (``--trainer.world_size``) on CPU with gloo: N ranks compute what one rank
would on the same batch (the global-count normalisation), the weights they send are the model's,
a failure on one rank ends the step on every rank within its deadline naming the rank, and a
sharded checkpoint restores a 2-rank trainer exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import sys
import time

import msgspec
import pytest
import pytest_asyncio
import torch

from asyncrl.rl.config.trainer import GRPOLossConfig, LoRAConfig, TrainerConfig
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.trainer.metrics import TrainStepMetrics
from asyncrl.runtime.supervisor import Supervisor
from tests.sampler_support import ONE_THREAD, write_tiny

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return write_tiny(str(tmp_path_factory.mktemp("tiny")))


def batch(seed: int, groups: int = 4, size: int = 3) -> list[RolloutGroup]:
    """Groups of uneven lengths (prompts 2-9 tokens, completions 1-14), rewards that differ within
    each group (else the advantages, and the gradient, would be zero)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(2, 9))]
        completions = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 14))] for _ in range(size)]
        out.append(
            RolloutGroup(
                g,
                prompt,
                completions,
                [[-rng.uniform(0.5, 3.0) for _ in c] for c in completions],
                [float(j == g % size) + 0.1 * j for j in range(size)],
                version=0,
            )
        )
    return out


async def spawn_plain(sup, path, config):
    from asyncrl.rl.trainer.actor import TrainerActor

    return await sup.spawn(TrainerActor, path, config, name="plain", env=ONE_THREAD)


async def spawn_ranks(sup, path, config, world_size=2, env=None):
    from asyncrl.rl.driver.fleet.trainer_ranks import spawn_trainer_ranks

    return await spawn_trainer_ranks(
        sup,
        path,
        dataclasses.replace(config, world_size=world_size),
        timeout_s=60.0,
        gpus=0,
        env={**ONE_THREAD, **(env or {})},
        options={},
        host=HOST,
    )


# LoRA at two ranks, one group shared by the gradient check and the save-and-sync check below (one
# start of three trainers, not two): both take the same first step on batch 1. No clipping, so the
# gradients compared are the step's own; a large lr, so the merged weights visibly move.
LORA = TrainerConfig(micro_batch_tokens=40, grad_clip=0.0, lr=1e-2, lora=LoRAConfig(rank=4))


@pytest.mark.parametrize(
    "aggregation,features",
    [("token_mean", {}), ("seq_mean", {"pack_tokens": 40})],
    ids=["token_mean", "seq_mean-packed"],
)
def test_two_ranks_compute_the_gradient_one_rank_computes_on_the_same_batch(tiny_path, aggregation, features):
    # A micro-batch budget that cuts each rank's share differently: the ranks take different
    # numbers of micro-batches, padded to match, and the counts must still be the global ones.
    # Packing (several sequences a row) takes the same path at any world size; LoRA: the next
    # test. The plain token_mean case also distils: the teacher's log-probs split with their rows
    # (docs/algorithms.md). The packed case also masks tokens (decoupled PPO with a token band):
    # the tally of what was masked, counts and extremes, is reduced over the ranks.
    distill = aggregation == "token_mean" and not features
    corrections = {} if distill or not features else {"decoupled": "recompute", "token_mask": (0.02, 1e9)}
    loss = GRPOLossConfig(aggregation=aggregation, distill_coef=0.5 if distill else 0.0, **corrections)
    config = TrainerConfig(micro_batch_tokens=40, grad_clip=0.0, loss=loss, **features)
    data = batch(1)
    if distill:
        data = [
            msgspec.structs.replace(
                g, teacher_logprobs=[[lp - 0.3 * (j % 3) for j, lp in enumerate(lps)] for lps in g.behaviour_logprobs]
            )
            for g in data
        ]

    async def main():
        async with Supervisor(call_timeout_s=120) as sup:
            plain, ranks = await asyncio.gather(
                spawn_plain(sup, tiny_path, config), spawn_ranks(sup, tiny_path, config)
            )
            one = await plain.train_step(data)
            two = await ranks.with_timeout(120).train_step(data)
            return one, two, await plain.gradients(), await ranks.with_timeout(60).gradients()

    one, two, g1, g2 = asyncio.run(main())
    assert_same_step(one, two, g1, g2)
    if corrections:
        assert 0 < one.masked_token_frac < 1, one
        for key in ("masked_token_frac", "masked_seq_frac", "behaviour_ratio_min", "behaviour_ratio_max"):
            assert getattr(two, key) == pytest.approx(getattr(one, key), rel=1e-5), key
        assert two.correction_by_length.keys() == one.correction_by_length.keys()
        for bucket, stats in one.correction_by_length.items():
            assert two.correction_by_length[bucket] == pytest.approx(stats, rel=1e-5), bucket


def assert_same_step(one: TrainStepMetrics, two: TrainStepMetrics, g1: dict, g2: dict) -> None:
    """One rank's step (stats ``one``, gradients ``g1``) and two ranks' on the same batch agree."""
    assert isinstance(one, TrainStepMetrics) and isinstance(two, TrainStepMetrics)  # typed across processes
    assert set(g1) == set(g2) and len(g1) > 5
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-5, rtol=1e-4), (name, (g1[name] - g2[name]).abs().max())
    assert max(float(g.abs().max()) for g in g1.values()) > 1e-4  # not trivially equal (all zero): 10x atol
    for key in ("loss", "pg_loss", "grad_norm", "tokens", "sequences", "entropy", "ratio_mean"):
        assert getattr(two, key) == pytest.approx(getattr(one, key), rel=1e-4, abs=1e-6), key


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora_trainers(tiny_path):
    """A 1-rank and a 2-rank LoRA trainer (`LORA`), each after one step on batch 1: (plain,
    ranks, plain's step stats, the ranks' step stats)."""
    async with Supervisor(call_timeout_s=120) as sup:
        plain, ranks = await asyncio.gather(spawn_plain(sup, tiny_path, LORA), spawn_ranks(sup, tiny_path, LORA))
        ranks = ranks.with_timeout(120)
        one, two = await asyncio.gather(plain.train_step(batch(1)), ranks.train_step(batch(1)))
        yield plain, ranks, one, two


@pytest.mark.asyncio(loop_scope="module")
async def test_two_lora_ranks_compute_the_gradient_one_rank_computes_on_the_same_batch(lora_trainers):
    """LoRA: the adapters' gradients, the frozen base sharded with them, as above."""
    plain, ranks, one, two = lora_trainers
    assert_same_step(one, two, await plain.gradients(), await ranks.gradients())


@pytest.mark.asyncio(loop_scope="module")
async def test_two_lora_ranks_save_and_sync_the_merged_policy_one_rank_would(lora_trainers, tiny_path, tmp_path):
    """LoRA at 2 ranks after a step: the final policy (merged from the gathered shards) equals a
    1-rank trainer's (peft's own merge) to 1e-5, the adapter is saved beside it, and the merged
    weights a sync sends (their digest) are the saved ones."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.rl.digest import tensor_digest
    from asyncrl.rl.trainer.checkpoint import ADAPTER_DIR

    plain, ranks, _, _ = lora_trainers
    one = await plain.save(str(tmp_path / "one"))
    two = await ranks.save(str(tmp_path / "two"))
    digest = await ranks.weights_digest()

    start = dict(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).named_parameters())
    w1 = dict(AutoModelForCausalLM.from_pretrained(one, dtype=torch.float32).named_parameters())
    w2 = dict(AutoModelForCausalLM.from_pretrained(two, dtype=torch.float32).named_parameters())
    assert set(w1) == set(w2) and tensor_digest(w2) == digest
    moved = [n for n in w1 if not torch.equal(w1[n], start[n])]
    assert moved and all("_proj.weight" in n for n in moved)  # the adapted projections, merged
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=1e-4, msg=name)
    a1, a2 = (load_file(os.path.join(d, ADAPTER_DIR, "adapter_model.safetensors")) for d in (one, two))
    assert set(a1) == set(a2) and a1
    for name in a1:  # whole adapters, not one rank's shards
        torch.testing.assert_close(a2[name], a1[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_per_rank_mean_would_differ_so_the_equality_above_is_not_trivial():
    """The split of test batch 1 gives the ranks different token counts: normalising each rank by
    its own count (the classic bug) would weigh their gradients differently."""
    from asyncrl.rl.trainer.loss import group_advantages
    from asyncrl.rl.trainer.split import batch_counts, rank_share

    data = batch(1)
    adv = group_advantages([list(g.rewards) for g in data])
    counts = [batch_counts(rank_share(data, adv, r, 2)[0])[0] for r in range(2)]
    assert sum(counts) == batch_counts(data)[0] and counts[0] != counts[1]
    lengths = [
        sum(len(g.prompt_ids) + len(c) for g in rank_share(data, adv, r, 2)[0] for c in g.completion_ids)
        for r in range(2)
    ]
    assert abs(lengths[0] - lengths[1]) <= 14 + 9  # balanced to within one sequence


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ranks_and_sampler(tiny_path):
    """A 2-rank trainer (default config) and a sampler (the real `SamplerActor`, HF backend),
    started together, shared by the sync and final-policy tests (each takes its own step first)."""
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.sampler.actor import SamplerActor

    async with Supervisor(call_timeout_s=120) as sup:
        ranks, sampler = await asyncio.gather(
            spawn_ranks(sup, tiny_path, TrainerConfig()),
            sup.spawn(SamplerActor, tiny_path, SamplerConfig(backend="hf"), name="sampler", env=ONE_THREAD),
        )
        yield ranks, sampler


@pytest.mark.asyncio(loop_scope="module")
async def test_two_ranks_send_the_weights_they_hold_a_bucket_at_a_time(ranks_and_sampler):
    """A weight sync from a 2-rank trainer to a sampler: the sampler's digest equals the
    trainer's after a step, with buckets far smaller than the model, so every bucket is gathered
    and sent in turn; then, after another step, the same as a delta (issue 50: rank 0 keeps the
    base, every rank still gathers every bucket)."""
    from asyncrl.comm.member import form_group

    ranks, sampler = ranks_and_sampler
    await ranks.with_timeout(120).train_step(batch(2))
    await form_group([ranks, sampler], HOST, timeout_s=30)
    buckets = await asyncio.gather(ranks.setup_sender(30.0, 16 << 10, delta=True), sampler.setup_receiver(30.0))
    for version in (1, 2):
        if version == 2:
            await ranks.with_timeout(120).train_step(batch(3))
        sent, _ = await asyncio.gather(ranks.send_weights(version), sampler.receive_weights(version))
        assert sent.delta == (version == 2), sent
        trainer_digest = await ranks.with_timeout(60).weights_digest()
        assert buckets[0] > 10 and trainer_digest == await sampler.weights_digest()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_final_policy_of_two_ranks_is_one_hugging_face_directory(ranks_and_sampler, tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.rl.digest import tensor_digest

    t = ranks_and_sampler[0].with_timeout(120)
    await t.train_step(batch(1))
    out = await t.save(str(tmp_path / "final"), {"note.json": "{}"})
    digest = await t.weights_digest()

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM" and os.path.exists(os.path.join(out, "note.json"))
    assert tensor_digest(dict(model.named_parameters())) == digest


@pytest.mark.parametrize("fault", ["raise", "sigkill"])
def test_a_rank_failing_mid_backward_ends_the_step_on_every_rank_naming_it(tiny_path, fault, capfd):
    """Rank 1 raises in the middle of the backward of step 2 (or is SIGKILLed there): rank 0,
    blocked in a collective, leaves it at once with a typed error; the verdict names rank 1."""
    from asyncrl.errors import ActorDiedError
    from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRankFailedError
    from asyncrl.rl.trainer.parallel import FAULT_ENV, FROZEN

    kind = "raise" if fault == "raise" else "hang"

    async def main():
        async with Supervisor(call_timeout_s=120) as sup:
            ranks = await spawn_ranks(
                sup, tiny_path, TrainerConfig(micro_batch_tokens=40), env={FAULT_ENV: f"1:2:{kind}"}
            )
            await ranks.with_timeout(60).train_step(batch(3))
            step = asyncio.ensure_future(ranks.with_timeout(60).train_step(batch(4)))
            if fault == "sigkill":  # rank 1 is frozen mid-backward: kill it there
                await until_said(capfd, f"[trainer-1]: {FAULT_ENV}: rank 1 {FROZEN}", 60.0)
                assert not step.done()
                ranks.handles[1].kill("test: SIGKILL mid-step")
            start = time.monotonic()
            with pytest.raises(BaseException) as info:
                await step
            left = time.monotonic() - start
            # Rank 0 is dead to the group now: a later call fails at once, typed.
            with pytest.raises(Exception) as after:
                await ranks.handles[0].with_timeout(10).train_step(batch(5))
            return info.value, left, after.value

    error, left, after = asyncio.run(main())
    if fault == "raise":
        assert isinstance(error, TrainerRankFailedError)
        assert "trainer rank 1 (trainer-1) failed during train_step: InjectedFault" in str(error)
        assert "rank(s) 0 left their collectives" in str(error)
        assert left < 15.0
    else:
        assert isinstance(error, ActorDiedError) and "trainer rank 1" in str(error), error
        assert left < 15.0
    assert "RankGroupClosedError" in str(after)


async def until_said(capfd, text: str, timeout_s: float) -> None:
    """Wait until this process's stderr (where the supervisor relays its actors' lines) has shown
    ``text``: an actor's own word that it got somewhere, not a guess at how long that takes."""
    deadline = time.monotonic() + timeout_s
    seen = ""
    while text not in seen:
        assert time.monotonic() < deadline, f"no actor said {text!r} within {timeout_s:g} s"
        await asyncio.sleep(0.02)
        seen += capfd.readouterr().err
    sys.stderr.write(seen)  # what was read stays in the test's report


def test_a_frozen_rank_ends_the_step_by_its_deadline(tiny_path):
    """Rank 1 freezes in the backward of step 1: the step ends by its deadline on every rank. The
    deadline (4 s) is short: a healthy step here takes well under a second, and what is checked
    is that the deadline ends it, with the usual margin for a loaded machine."""
    from asyncrl.rl.trainer.parallel import FAULT_ENV

    async def main():
        async with Supervisor(call_timeout_s=120) as sup:
            ranks = await spawn_ranks(sup, tiny_path, TrainerConfig(), env={FAULT_ENV: "1:1:hang"})
            start = time.monotonic()
            with pytest.raises(BaseException) as info:
                await ranks.with_timeout(4).train_step(batch(3))
            return info.value, time.monotonic() - start

    error, took = asyncio.run(main())
    assert took < 8.0, took
    assert "StepDeadlineError" in repr(error) or "did not finish" in str(error) or "no reply" in str(error), error


def test_a_sharded_checkpoint_restores_two_ranks_exactly(tiny_path, tmp_path):
    """Steps 1-2, checkpoint, step 3 (A); a new 2-rank trainer loads the checkpoint and takes
    step 3 (B): the same loss and the same weights, bit for bit."""
    import msgspec

    from asyncrl.rl.checkpoint import list_checkpoints, verify_checkpoint
    from asyncrl.rl.driver.run_state import RunState

    config = TrainerConfig(micro_batch_tokens=40)
    state = msgspec.json.encode(RunState(step=2, version=2))

    async def main():
        async with Supervisor(call_timeout_s=120) as sup:
            first = await spawn_ranks(sup, tiny_path, config)
            t = first.with_timeout(120)
            await t.train_step(batch(1))
            await t.train_step(batch(2))
            path = await t.save_checkpoint(str(tmp_path), 2, 2, state)
            a = await t.train_step(batch(3))
            digest_a = await t.weights_digest()
            for h in first.handles:
                await sup.stop(h)
            second = await spawn_ranks(sup, tiny_path, config)
            t = second.with_timeout(120)
            assert await t.load_checkpoint(path) == 2
            b = await t.train_step(batch(3))
            return path, a, b, digest_a, await t.weights_digest()

    path, a, b, digest_a, digest_b = asyncio.run(main())
    (checkpoint,) = list_checkpoints(str(tmp_path))
    assert checkpoint.path == path and verify_checkpoint(checkpoint)
    assert sorted(os.listdir(path)) == ["MANIFEST.json", "dcp", "rng", "run_state.json", "trainer.json", "trainer.pt"]
    assert a.loss == b.loss and a.grad_norm == b.grad_norm
    assert digest_a == digest_b


@pytest.mark.timeout(300)  # two whole runs, the failed one and its resume: 110 s was seen on a loaded CI machine
def test_two_trainer_ranks_and_a_sampler_run_the_example_stop_naming_a_failed_rank_and_resume(tmp_path, model_cache):
    """The example end to end with ``--trainer.world_size 2``: rank 1 raises mid-backward at step
    3, the run stops naming it and saying how to resume; the resumed run ends well, with a final
    policy that transformers loads."""
    from transformers import AutoModelForCausalLM

    from asyncrl.rl.trainer.parallel import FAULT_ENV
    from tests.launch_support import launch_example
    from tests.test_grpo import TINY

    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "--trainer.world_size",
        "2",
        "--run.steps",
        "4",
        "--run.checkpoint_every",
        "2",
        "--run.eval_every",
        "1000",
        "--run.run_dir",
        str(run_dir),
    ]
    os.environ[FAULT_ENV] = "1:3:raise"  # the launched processes inherit it
    try:
        stopped = launch_example("grpo_countdown.py", tmp_path, *args, timeout=400, cache=model_cache)
    finally:
        del os.environ[FAULT_ENV]
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0, out[-3000:]
    assert "trainer rank 1 (trainer-1) failed during train_step: InjectedFault" in out, out[-3000:]
    assert "rank(s) 0 left their collectives" in out and "--resume" in out, out[-3000:]
    resumed = launch_example(
        "grpo_countdown.py", tmp_path, *args, "--resume", str(run_dir), timeout=400, cache=model_cache
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "step-00000004" / "dcp").is_dir()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert type(model).__name__ == "Qwen2ForCausalLM"
