"""The trainer's batching: micro-batches by token budget, and completion scores read at the right
(causally shifted) positions of sequences with different prompt lengths. Its writes: a directory
(checkpoint, final or best policy) appears whole or not at all, a kill included."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncrl.rl.checkpoint import CheckpointWriteError
from asyncrl.rl.model.policy import MARKER_FILE, load_policy
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scoring.tokens import token_logprobs
from asyncrl.rl.trainer.batching import micro_batches
from asyncrl.rl.trainer.loss import group_advantages
from asyncrl.rl.trainer.metrics import TrainStepMetrics
from asyncrl.runtime.files import remove_debris, remove_dir, staged_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def group(prompt_id, prompt, completions, rewards):
    return RolloutGroup(
        prompt_id,
        prompt,
        completions,
        [[-1.0 - 0.1 * j for j in range(len(c))] for c in completions],
        rewards,
        version=0,
    )


GROUPS = [
    group(0, [5, 6, 7], [[1, 2], [3], [4, 4, 4, 4]], [1.0, 0.0, 0.1]),
    group(1, [9], [[2, 2, 2], [8]], [0.0, 1.0]),
]


def test_every_completion_token_is_scored_by_the_logit_before_it():
    torch.manual_seed(0)
    adv = group_advantages([list(g.rewards) for g in GROUPS])
    (batch,) = micro_batches(GROUPS, adv, budget=10_000, device=torch.device("cpu"))
    logits = torch.randn(*batch.input_ids.shape, 11)
    scored = token_logprobs(logits, batch.input_ids).gather(1, batch.score_index)
    seen = 0
    for row in range(batch.input_ids.shape[0]):
        ids = batch.input_ids[row][batch.attention[row].bool()].tolist()
        for g in GROUPS:
            for c in g.completion_ids:
                if ids == g.prompt_ids + c:
                    p = len(g.prompt_ids)
                    for j, token in enumerate(c):
                        manual = torch.log_softmax(logits[row, p - 1 + j], -1)[token]
                        assert torch.isclose(scored[row, j], manual)
                        assert batch.mask[row, j]
                    assert not batch.mask[row, len(c) :].any()
                    seen += 1
    assert seen == 5 and int(batch.mask.sum()) == 2 + 1 + 4 + 3 + 1


def test_micro_batches_respect_the_token_budget_and_keep_every_sequence_once():
    adv = group_advantages([list(g.rewards) for g in GROUPS])
    batches = micro_batches(GROUPS, adv, budget=8, device=torch.device("cpu"))
    assert len(batches) > 1
    for b in batches:
        assert b.input_ids.numel() <= 8 or b.input_ids.shape[0] == 1
    assert sum(b.input_ids.shape[0] for b in batches) == 5
    got = sorted(float(a) for b in batches for a in b.advantages)
    assert got == sorted(float(a) for a in adv)
    # the behaviour log-probs travel with their tokens
    for b in batches:
        for row in range(b.mask.shape[0]):
            n = int(b.mask[row].sum())
            assert torch.allclose(b.behaviour[row, :n], torch.tensor([-1.0 - 0.1 * j for j in range(n)]))


def test_teacher_logprobs_travel_with_their_tokens_padded_packed_and_split():
    import msgspec

    from asyncrl.rl.trainer.packing import packed_micro_batches
    from asyncrl.rl.trainer.split import rank_share

    # each teacher log-prob encodes its token: 10 * token + position, so a misplaced one shows
    taught = [
        msgspec.structs.replace(
            g, teacher_logprobs=[[10.0 * tok + j for j, tok in enumerate(c)] for c in g.completion_ids]
        )
        for g in GROUPS
    ]
    adv = group_advantages([list(g.rewards) for g in taught])
    cpu = torch.device("cpu")
    for batches in (micro_batches(taught, adv, 8, cpu), packed_micro_batches(taught, adv, 16, cpu, 16)):
        seen = 0
        for b in batches:
            ids = b.input_ids[b.row.unsqueeze(1), b.score_index + 1]  # the token each score is of
            n = b.mask.sum(1)
            for s in range(b.mask.shape[0]):
                expected = [10.0 * tok + j for j, tok in enumerate(ids[s, : n[s]].tolist())]
                assert b.teacher[s, : n[s]].tolist() == expected
                seen += 1
        assert seen == 5
    share, _ = rank_share(taught, adv, 1, 2)
    assert all(len(g.teacher_logprobs) == len(g.completion_ids) for g in share)
    assert micro_batches(GROUPS, adv, 8, cpu)[0].teacher is None  # no teacher: nothing built
    from asyncrl.rl.rollout import InvalidGroupError, validate_group

    validate_group(taught[0])
    with pytest.raises(InvalidGroupError, match="completion 1 has 1 token ids but 2 teacher log-probs"):
        validate_group(msgspec.structs.replace(taught[0], teacher_logprobs=[[0.0, 0.0], [0.0, 0.0], [0.0] * 4]))
    half = [taught[0], GROUPS[1]]
    with pytest.raises(ValueError, match="no teacher log-probs"):
        micro_batches(half, adv, 10_000, cpu)


def test_a_teacher_s_top_k_travels_with_its_tokens_padded_packed_and_split():
    import msgspec

    from asyncrl.rl.trainer.packing import packed_micro_batches
    from asyncrl.rl.trainer.split import rank_share

    # K 2 at each position: ids (token, token + 1), log-probs (-position, -position - 0.5)
    taught = [
        msgspec.structs.replace(
            g,
            teacher_top_k=2,
            teacher_topk_ids=[[i for tok in c for i in (tok, tok + 1)] for c in g.completion_ids],
            teacher_topk_logprobs=[[v for j in range(len(c)) for v in (-j, -j - 0.5)] for c in g.completion_ids],
        )
        for g in GROUPS
    ]
    adv = group_advantages([list(g.rewards) for g in taught])
    cpu = torch.device("cpu")
    for batches in (micro_batches(taught, adv, 8, cpu), packed_micro_batches(taught, adv, 16, cpu, 16)):
        seen = 0
        for b in batches:
            ids = b.input_ids[b.row.unsqueeze(1), b.score_index + 1]
            for s in range(b.mask.shape[0]):
                n = int(b.mask[s].sum())
                assert b.teacher_ids[s, :n].tolist() == [[tok, tok + 1] for tok in ids[s, :n].tolist()]
                assert b.teacher_topk[s, :n].tolist() == [[-j, -j - 0.5] for j in range(n)]
                seen += 1
        assert seen == 5 and all(b.teacher is None for b in batches)
    share, _ = rank_share(taught, adv, 1, 2)
    assert all(len(g.teacher_topk_ids) == len(g.completion_ids) for g in share)
    assert micro_batches(GROUPS, adv, 8, cpu)[0].teacher_ids is None
    with pytest.raises(ValueError, match="teacher top-K differ"):
        micro_batches([taught[0], GROUPS[1]], adv, 10_000, cpu)


def test_environment_tokens_are_context_not_actions():
    """A multi-turn completion: the environment's tokens (action mask 0) stay in the input, but
    are outside the loss mask, so neither their (placeholder) behaviour log-probs nor their count
    touch the loss or its normaliser."""
    env = RolloutGroup(
        0,
        [5, 6],
        [[1, 2, 9, 9, 3], [4]],
        [[-1.0, -1.1, 0.0, 0.0, -1.2], [-0.5]],
        [1.0, 0.0],
        version=0,
        action_mask=[[1, 1, 0, 0, 1], [1]],
    )
    adv = group_advantages([list(env.rewards)])
    (batch,) = micro_batches([env], adv, budget=10_000, device=torch.device("cpu"))
    row = next(r for r in range(2) if batch.attention[r].sum() == 7)
    assert batch.input_ids[row, :7].tolist() == [5, 6, 1, 2, 9, 9, 3]  # the reply is context
    assert batch.mask[row, :5].tolist() == [True, True, False, False, True]
    assert int(batch.mask.sum()) == 4


def test_a_trainer_step_neither_trains_on_nor_counts_environment_tokens(trainer):
    def step(env_logprob: float) -> tuple[dict, list[torch.Tensor]]:
        torch.manual_seed(0)
        g = RolloutGroup(
            0,
            [5, 6],
            [[1, 2, 9, 9, 3], [4, 7]],
            [[-1.0, -1.1, env_logprob, env_logprob, -1.2], [-0.5, -0.4]],
            [1.0, 0.0],
            version=0,
            action_mask=[[1, 1, 0, 0, 1], [1, 1]],
        )
        before = [p.detach().clone() for p in trainer.model.parameters()]
        metrics = trainer.train_share([g])
        grads = [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]
        with torch.no_grad():  # undo the step: the same start for the second call
            for p, b in zip(trainer.model.parameters(), before):
                p.copy_(b)
        return metrics, grads

    first, grads_a = step(0.0)
    _, grads_b = step(-50.0)  # what sits at environment positions must not matter
    assert first.tokens == 5.0
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_a_micro_batch_that_runs_out_of_memory_is_one_clear_error_and_the_trainer_goes_on(trainer, monkeypatch):
    """The device's own out-of-memory error is injected on the second micro-batch (no CPU can run
    out on demand); what is tested is ours: the message names the settings that help, the partial
    gradients are dropped, no optimiser step is taken, and the next step trains."""
    import dataclasses

    from asyncrl.rl.trainer.out_of_memory import TrainerMemoryError

    trainer.config = dataclasses.replace(trainer.config, micro_batch_tokens=8)  # one sequence a micro-batch
    g = RolloutGroup(0, [5, 6], [[1, 2, 3], [4, 7, 8]], [[-1.0, -1.1, -1.2], [-0.5, -0.4, -0.3]], [1.0, 0.0], version=0)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    real, calls = trainer._accumulate, []

    def second_runs_out(batch, normalizer):
        calls.append(batch.input_ids.shape)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB.")
        return real(batch, normalizer)

    monkeypatch.setattr(trainer, "_accumulate", second_runs_out)
    with pytest.raises(TrainerMemoryError) as err:
        trainer.train_share([g])
    message = str(err.value)
    assert message.startswith("train step 1 ran out of cpu memory on a micro-batch of 1 x 5 tokens")
    assert "--trainer.micro_batch_tokens 8" in message and "--trainer.activation_checkpointing" in message
    assert message.endswith("torch: CUDA out of memory. Tried to allocate 9.27 GiB.")
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before)) and trainer.steps == 0
    monkeypatch.setattr(trainer, "_accumulate", real)
    assert trainer.train_share([g]).micro_batches == 2 and trainer.steps == 1


async def test_the_held_out_evaluation_solves_the_runs_held_out_split_and_leaves_the_policy_training(trainer):
    """``evaluate`` (``trainer/heldout.py``): the task built from its spec in the trainer, the
    held-out problems the driver checked (``data``), greedy and sampled rates, train mode after."""
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.tasks.countdown import Countdown
    from asyncrl.rl.tasks.loading import TaskSpec
    from asyncrl.rl.trainer.heldout import HeldoutEvaluation

    trainer.heldout = HeldoutEvaluation(TaskSpec("countdown"), DataConfig(data_seed=3, n_heldout=4))
    found = await trainer.evaluate(samples=2, max_new_tokens=4, batch_size=8)
    assert set(found) >= {"greedy", "sampled"} and all(0.0 <= found[k] <= 1.0 for k in ("greedy", "sampled"))
    assert trainer.heldout._heldout == list(Countdown().splits(3, 1, 4).heldout)
    assert trainer.model.training
    # The task's call threads are the evaluation's: its owner's stop ends them.
    assert task_threads(), "the evaluation ran its scoring on no thread of its own"
    await trainer.on_stop()
    deadline = time.monotonic() + 10
    for t in task_threads():
        t.join(timeout=max(deadline - time.monotonic(), 0))
    assert not task_threads(), f"left running after the trainer stopped: {task_threads()}"


def task_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("task-countdown-") and t.is_alive()]


def test_a_trainer_step_takes_the_loss_variants_normaliser_and_shaping(trainer):
    """The call site, not the formulas (tests/test_loss.py): one step's loss under Dr. GRPO's
    constant normaliser is the token mean's x tokens / (sequences x budget), over micro-batches
    of one sequence too; DAPO's shaping gives equal rewards a signal; GSPO and CISPO train."""
    import dataclasses

    from asyncrl.rl.config.trainer import GRPOLossConfig

    before = [p.detach().clone() for p in trainer.model.parameters()]

    def step(micro_batch_tokens=0, **loss) -> TrainStepMetrics:
        trainer.config = dataclasses.replace(
            trainer.config, loss=GRPOLossConfig(**loss), micro_batch_tokens=micro_batch_tokens
        )
        metrics = trainer.train_share(GROUPS)
        with torch.no_grad():  # the same weights for every call
            for p, b in zip(trainer.model.parameters(), before):
                p.copy_(b)
        return metrics

    mean = step()
    fixed = step(aggregation="fixed_tokens", token_budget=16)
    assert (mean.tokens, mean.sequences) == (11.0, 5.0)
    assert fixed.pg_loss == pytest.approx(mean.pg_loss * 11 / (5 * 16), rel=1e-5)
    split = step(micro_batch_tokens=8, aggregation="fixed_tokens", token_budget=16)
    assert split.micro_batches > 1 and split.pg_loss == pytest.approx(fixed.pg_loss, rel=1e-5)
    for policy_loss in ("gspo", "cispo"):
        m = step(policy_loss=policy_loss)
        assert math.isfinite(m.loss) and m.grad_norm > 0, (policy_loss, m)
    even = [group(0, [5, 6], [[1, 2], [3, 3, 3, 3, 3, 3]], [1.0, 1.0])]
    trainer.config = dataclasses.replace(trainer.config, loss=GRPOLossConfig())
    assert trainer.train_share(even).grad_norm == 0.0  # equal rewards: no signal
    trainer.config = dataclasses.replace(trainer.config, loss=GRPOLossConfig(overlong_buffer=4, overlong_max_tokens=6))
    assert trainer.train_share(even).grad_norm > 0  # the 6-token completion is the worse one now


def spanned(groups: list[RolloutGroup]) -> list[RolloutGroup]:
    """``groups`` begun at version 1, each completion of two tokens or more switching to version
    2 at its second token and to 4 at its fourth: a completion that straddled weight updates."""
    import msgspec

    from asyncrl.rl.rollout import VersionSpan

    def spans(n: int) -> list[VersionSpan]:
        edges = [(0, 1), (1, 2), (3, 4)]
        return [VersionSpan(start, v) for start, v in edges if start < max(n, 1)]

    return [
        msgspec.structs.replace(g, version=1, version_spans=[spans(len(c)) for c in g.completion_ids]) for g in groups
    ]


def test_token_versions_travel_with_their_tokens_padded_packed_and_split():
    from asyncrl.rl.trainer.packing import packed_micro_batches
    from asyncrl.rl.trainer.split import rank_share

    groups = spanned(GROUPS)
    adv = group_advantages([list(g.rewards) for g in groups])
    by_ids = {tuple(c): g.token_versions(i) for g in groups for i, c in enumerate(g.completion_ids)}
    assert by_ids[(4, 4, 4, 4)] == [1, 2, 2, 4] and by_ids[(3,)] == [1]
    cpu = torch.device("cpu")
    for batches in (micro_batches(groups, adv, 8, cpu), packed_micro_batches(groups, adv, 16, cpu, 16)):
        seen = 0
        for b in batches:
            ids = b.input_ids[b.row.unsqueeze(1), b.score_index + 1]
            n = b.mask.sum(1)
            for s in range(b.mask.shape[0]):
                assert b.versions[s, : n[s]].tolist() == by_ids[tuple(ids[s, : n[s]].tolist())]
                seen += 1
        assert seen == 5
    for rank in (0, 1):  # a rank's share keeps each completion's spans
        share, _ = rank_share(groups, adv, rank, 2)
        for g in share:
            assert [g.token_versions(i) for i in range(g.group_size)] == [by_ids[tuple(c)] for c in g.completion_ids]


def test_a_trainer_step_with_a_correction_reports_it_by_the_tokens_version_lag(trainer):
    """The trainer holds version 4 (four steps taken): the tokens of versions 1, 2, 4 are at lags
    3, 2, 0. A band no ratio leaves masks nothing and changes no gradient; the step record says
    how many tokens each lag had, and each completion counts at its oldest token (lag 3)."""
    import dataclasses

    from asyncrl.rl.config.trainer import GRPOLossConfig

    groups = spanned(GROUPS)
    trainer.policy.steps = 4
    before = [p.detach().clone() for p in trainer.model.parameters()]

    def step(loss: GRPOLossConfig) -> tuple[TrainStepMetrics, list[torch.Tensor]]:
        trainer.config = dataclasses.replace(trainer.config, loss=loss)
        metrics = trainer.train_share(groups)
        grads = [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]
        with torch.no_grad():
            for p, b in zip(trainer.model.parameters(), before):
                p.copy_(b)
        trainer.policy.steps = 4
        return metrics, grads

    plain, plain_grads = step(GRPOLossConfig())
    assert plain.correction_by_lag is None and plain.masked_token_frac is None  # nothing new without one
    wide, wide_grads = step(GRPOLossConfig(token_mask=(0.0, math.inf)))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, wide_grads))
    # tokens by lag: [1, 2] -> 3, 2; [3] -> 3; [4, 4, 4, 4] -> 3, 2, 2, 0; [2, 2, 2] -> 3, 2, 2; [8] -> 3
    by_lag = wide.correction_by_lag
    assert {k: v["tokens"] for k, v in by_lag.items()} == {"3": 5.0, "2": 5.0, "0": 1.0}
    assert by_lag["3"]["sequences"] == 5.0 and by_lag["2"]["sequences"] == 0.0
    assert wide.masked_token_frac == 0.0 and wide.all_masked == 0.0
    assert wide.correction_by_length == {"1-16": {**wide.correction_by_length["1-16"], "tokens": 11.0}}
    assert 0 < wide.behaviour_ratio_min <= wide.behaviour_ratio_mean <= wide.behaviour_ratio_max
    # every token out: no gradient, the step counted as all masked, nothing NaN
    shut, shut_grads = step(GRPOLossConfig(decoupled="recompute", token_mask=(1e6, 1e7)))
    assert shut.all_masked == 1.0 and shut.masked_seq_frac == 1.0 and shut.loss == 0.0
    assert all(g.abs().max() == 0 for g in shut_grads)
    loglinear, _ = step(GRPOLossConfig(decoupled="loglinear", seq_mask=(0.0, math.inf)))
    assert math.isfinite(loglinear.loss) and loglinear.grad_norm > 0


def test_pi_prox_recomputed_is_the_step_s_own_forward(trainer):
    """decoupled 'recompute' takes pi_prox, the policy before the step, from the step's own
    forward (detached) instead of a second pass: one optimiser step a batch means that forward
    runs with those weights. A separate no-grad forward gives the same log-probs."""
    from asyncrl.rl.scoring.logprobs import scored_logprobs

    adv = group_advantages([list(g.rewards) for g in GROUPS])
    (batch,) = micro_batches(GROUPS, adv, budget=10_000, device=torch.device("cpu"))
    fused = not trainer.fallback_reason()
    with_grad, _ = scored_logprobs(trainer.model, batch, 1.0, fused=fused)
    assert with_grad.requires_grad
    with torch.no_grad():
        separate, _ = scored_logprobs(trainer.model, batch, 1.0, fused=fused)
    assert torch.equal(torch.where(batch.mask, separate, 0.0), torch.where(batch.mask, with_grad.detach(), 0.0))


# --- writing a directory whole (checkpoints, the final and best policies) -------------------------


def test_staged_dir_replaces_a_directory_whole(tmp_path):
    final = tmp_path / "policy"
    with staged_dir(str(final)) as tmp:
        (Path(tmp) / "a").write_text("old")
    with staged_dir(str(final), fsync=True) as tmp:
        assert os.listdir(tmp) == []
        (Path(tmp) / "b").write_text("new")
        assert os.listdir(final) == ["a"]  # readers see the old one until the rename
    assert os.listdir(final) == ["b"] and os.listdir(tmp_path) == ["policy"]


def test_a_failed_staged_write_keeps_the_old_directory_and_leaves_no_debris(tmp_path, monkeypatch):
    final = tmp_path / "policy"
    with staged_dir(str(final)) as tmp:
        (Path(tmp) / "a").write_text("old")
    with pytest.raises(RuntimeError, match="disk"):
        with staged_dir(str(final)) as tmp:
            (Path(tmp) / "b").write_text("half")
            raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == ["policy"] and os.listdir(final) == ["a"]
    real = os.replace

    def refuse_the_new_name(src, dst):
        if dst == str(final) and ".tmp-" in src:
            raise OSError(errno.EIO, os.strerror(errno.EIO), dst)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", refuse_the_new_name)
    with pytest.raises(OSError, match="Input/output error"):
        with staged_dir(str(final)) as tmp:
            (Path(tmp) / "b").write_text("new")
    assert os.listdir(tmp_path) == ["policy"] and os.listdir(final) == ["a"]  # the old one put back


def test_a_kill_between_the_renames_leaves_each_directory_whole_under_a_name_of_its_own(tmp_path):
    """SIGKILL right after the old directory is renamed aside: nothing is half-written or
    half-deleted, and the writer's next pass (`remove_debris`) clears what the kill left."""
    final = tmp_path / "policy"
    script = f"""
import os, signal
from pathlib import Path
from asyncrl.runtime.files import staged_dir
final = {str(final)!r}
with staged_dir(final) as tmp:
    (Path(tmp) / "a").write_text("old")
real = os.replace
def replace_then_die(src, dst):
    real(src, dst)
    if src == final:
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace_then_die
with staged_dir(final) as tmp:
    (Path(tmp) / "b").write_text("new")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    names = sorted(os.listdir(tmp_path))
    pid = names[0].rsplit("-", 1)[-1]
    assert names == [f".old-policy-{pid}", f".tmp-policy-{pid}"]
    assert os.listdir(tmp_path / names[0]) == ["a"] and (tmp_path / names[0] / "a").read_text() == "old"
    assert os.listdir(tmp_path / names[1]) == ["b"] and (tmp_path / names[1] / "b").read_text() == "new"
    remove_debris(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_remove_dir_renames_aside_before_deleting(tmp_path, monkeypatch):
    victim = tmp_path / "step-00000001"
    (victim / "model").mkdir(parents=True)
    (victim / "model" / "w").write_bytes(b"w" * 100)
    seen = []
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kw: seen.append(os.path.basename(path)))
    remove_dir(str(victim))
    assert seen == [f".old-step-00000001-{os.getpid()}"] and not victim.exists()  # gone from its name first


# --- the trainer actor's policy writes ------------------------------------------------------------


@pytest.fixture
def trainer(tmp_path):
    from asyncrl.rl.config.model import ModelConfig
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.model.warm_start import new_model
    from asyncrl.rl.trainer.actor import TrainerActor

    path = tmp_path / "start"
    tok = build_tokenizer()
    new_model(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=32, max_positions=64),
        tok,
    ).save_pretrained(path)
    tok.save_pretrained(path)
    (path / MARKER_FILE).write_text(json.dumps({"prompt_style": "compact", "max_new_tokens_hint": 20}))
    return TrainerActor(str(path))


def test_save_writes_a_loadable_policy_with_its_files_in_one_rename(trainer, tmp_path):
    out = tmp_path / "run" / "best"
    out.parent.mkdir()
    assert asyncio.run(trainer.save(str(out), {"best.json": '{"step": 1}'})) == str(out)
    _, _, fmt = load_policy(str(out))
    assert fmt.style == "compact" and fmt.max_new_tokens_hint == 20  # the marker travelled with it
    assert json.loads((out / "best.json").read_text()) == {"step": 1}
    assert json.loads((out / "asyncrl_trainer.json").read_text())["steps"] == 0
    asyncio.run(trainer.save(str(out), {}))  # replaced whole: best.json described the old policy
    assert not (out / "best.json").exists() and os.listdir(out.parent) == ["best"]


def test_a_failed_save_is_one_line_and_keeps_the_old_policy(trainer, tmp_path, monkeypatch):
    out = tmp_path / "final"
    asyncio.run(trainer.save(str(out), {"best.json": "old"}))

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model.safetensors")

    monkeypatch.setattr(trainer.model, "save_pretrained", full_disk)
    with pytest.raises(CheckpointWriteError) as info:
        asyncio.run(trainer.save(str(out), {"best.json": "new"}))
    assert str(info.value) == f"cannot write the policy to {out}: No space left on device"
    assert os.listdir(tmp_path) == ["final", "start"] and (out / "best.json").read_text() == "old"


def test_the_learning_rate_warms_up_then_decays_along_its_schedule_to_the_floor():
    from asyncrl.rl.config.trainer import TrainerConfig
    from asyncrl.rl.trainer.schedule import learning_rate

    flat = TrainerConfig(lr=1e-3, lr_warmup_steps=4, lr_decay_steps=100)
    assert [learning_rate(flat, s) for s in (0, 1, 3, 4, 99, 500)] == pytest.approx(
        [2.5e-4, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3]
    )
    cosine = TrainerConfig(lr=1e-3, lr_schedule="cosine", lr_decay_steps=100, lr_min_ratio=0.1)
    assert learning_rate(cosine, 0) == pytest.approx(1e-3)
    assert learning_rate(cosine, 50) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way down the half cosine
    assert learning_rate(cosine, 100) == learning_rate(cosine, 400) == pytest.approx(1e-4)  # the floor, and it stays
    rates = [learning_rate(cosine, s) for s in range(101)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    linear = TrainerConfig(lr=1e-3, lr_schedule="linear", lr_warmup_steps=10, lr_decay_steps=110, lr_min_ratio=0.0)
    assert learning_rate(linear, 9) == pytest.approx(1e-3) and learning_rate(linear, 60) == pytest.approx(5e-4)
    assert learning_rate(linear, 110) == 0.0
    for bad, match in [
        ({"lr_schedule": "step"}, "lr_schedule must be one of constant, cosine, linear"),
        ({"lr_min_ratio": 1.5}, "lr_min_ratio must be in"),
        ({"lr_warmup_steps": -1}, "lr_warmup_steps"),
    ]:
        with pytest.raises(ValueError, match=match):
            TrainerConfig(**bad)


def test_a_decaying_schedule_ends_at_the_run_s_last_step_unless_it_names_its_own():
    from asyncrl.rl.config import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides

    run = parse_overrides(GRPOConfig(), ["--run.steps", "321", "--trainer.lr_schedule", "cosine"])
    assert run.trainer.lr_decay_steps == 0 and run.trainer_config().lr_decay_steps == 321
    own = parse_overrides(GRPOConfig(), ["--run.steps", "321", "--trainer.lr_decay_steps", "200"])
    assert own.trainer_config().lr_decay_steps == 200


def test_the_learning_rate_auto_is_the_embedded_model_s_or_a_checkpoint_s_and_10x_with_lora():
    from asyncrl.rl.config import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides
    from asyncrl.rl.config.trainer import TrainerConfig

    def lr(*flags: str) -> float:
        return parse_overrides(GRPOConfig(), list(flags)).trainer_config().lr

    assert GRPOConfig().trainer.lr == 0.0  # auto, kept as 'auto' in config.json
    assert lr() == 1e-4 and lr("--trainer.lora.rank", "8") == pytest.approx(1e-3)
    assert lr("--model_path", "/ckpt") == 1e-6
    assert lr("--model_path", "/ckpt", "--trainer.lora.rank", "8") == pytest.approx(1e-5)
    assert lr("--model_path", "/ckpt", "--trainer.lr", "3e-5") == 3e-5  # a rate given is the rate used
    assert TrainerConfig().peak_lr() == 1e-4 and TrainerConfig(lr=2e-3).peak_lr(checkpoint=True) == 2e-3
    for bad in (-1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr must be > 0, or 0 for auto"):
            TrainerConfig(lr=bad)


def test_each_optimiser_step_takes_the_scheduled_rate_and_reports_it(trainer):
    import dataclasses

    trainer.config = dataclasses.replace(
        trainer.config, lr=1e-2, lr_schedule="linear", lr_decay_steps=3, lr_min_ratio=0.0
    )
    rates = []
    for _ in range(4):
        metrics = trainer.train_share(GROUPS)
        rates.append(metrics.lr)
        assert trainer.optimizer.param_groups[0]["lr"] == metrics.lr
    assert rates == pytest.approx([1e-2, 1e-2 * 2 / 3, 1e-2 / 3, 0.0])
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_share(GROUPS)  # at the floor of 0 nothing moves (AdamW's decay is 0 here too)
    assert all(torch.equal(a, b) for a, b in zip(weights, trainer.model.parameters()))
