"""LoRA with peft (``rl/model/lora.py``, ``rl/trainer/lora.py``): the merged sync under the base
model's names, the adapter-only sync bit-exact into an HF sampler over gloo, exact resume from a
checkpoint holding the adapter, and the final export (merged checkpoint + adapter directory)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("peft")

from asyncrl import Supervisor  # noqa: E402
from asyncrl.comm.member import form_group  # noqa: E402
from asyncrl.rl.config.grpo import GRPOConfig  # noqa: E402
from asyncrl.rl.config.parse import ConfigError  # noqa: E402
from asyncrl.rl.config.run import DataConfig  # noqa: E402
from asyncrl.rl.config.sampler import SamplerConfig  # noqa: E402
from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig  # noqa: E402
from asyncrl.rl.model.lora import adapter_tensors  # noqa: E402
from test_packing import random_groups  # noqa: E402

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

HOST = "127.0.0.1"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def trainer(path: str, **lora) -> object:
    from asyncrl.rl.trainer.actor import TrainerActor

    torch.set_num_threads(1)
    return TrainerActor(path, TrainerConfig(lr=1e-2, lora=LoRAConfig(rank=4, **lora)))


def test_merged_sync_sends_the_base_models_tensors_with_the_adapters_merged(embedded_path):
    from asyncrl.rl.model.policy import load_policy
    from asyncrl.rl.trainer.lora import merged_copy

    t = trainer(embedded_path)
    base = dict(load_policy(embedded_path)[0].named_parameters())
    sent = t.policy.weight_tensors()
    assert {k: (v.shape, v.dtype) for k, v in sent.items()} == {k: (v.shape, v.dtype) for k, v in base.items()}
    assert all(torch.equal(sent[k], base[k]) for k in base)  # fresh adapters (B = 0) change nothing
    assert len(t.optimizer.param_groups[0]["params"]) == 2 * 2 * 7  # A and B of 7 modules in 2 layers only
    t.train_share(random_groups(seed=1))
    sent = t.policy.weight_tensors()
    merged = dict(merged_copy(t.model).named_parameters())
    changed = {k for k in base if not torch.equal(sent[k], base[k])}
    assert len(changed) == 2 * 7 and all(".layers." in k for k in changed)  # the adapted weights, nothing else
    assert all(torch.equal(sent[k], merged[k]) for k in base)  # what peft's merge_and_unload gives, bit for bit


async def test_adapter_only_sync_is_bit_exact_into_the_hf_sampler_over_gloo(embedded_path):
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.trainer.actor import TrainerActor

    lora = LoRAConfig(rank=4, sync="adapter")
    async with Supervisor(call_timeout_s=120) as sup:
        t, s = await asyncio.gather(
            sup.spawn(TrainerActor, embedded_path, TrainerConfig(lr=1e-2, lora=lora), name="trainer", env=ONE_THREAD),
            sup.spawn(
                SamplerActor,
                embedded_path,
                SamplerConfig(backend="hf", group_size=2, max_new_tokens=8),
                name="sampler",
                env=ONE_THREAD,
                kwargs=dict(adapter=lora, data=DataConfig(n_train=20, n_heldout=8, data_seed=0)),
            ),
        )
        await form_group([t, s], HOST, timeout_s=60)
        await asyncio.gather(t.setup_sender(30), s.setup_receiver(30))
        assert await t.weights_digest() != await s.weights_digest()  # each drew its own A
        for version in (1, 2):
            await t.train_step(random_groups(seed=version))
            await asyncio.gather(t.send_weights(version), s.receive_weights(version))
            assert await t.weights_digest() == await s.weights_digest()  # the adapters, bit for bit
        assert (await s.stats()).version == 2


def test_adapter_only_sync_moves_only_the_adapters(embedded_path):
    t = trainer(embedded_path, sync="adapter")
    sent = t.policy.weight_tensors()
    assert sent.keys() == adapter_tensors(t.model).keys() and len(sent) == 2 * 2 * 7
    full = sum(p.numel() for p in t.model.get_base_model().parameters() if not p.requires_grad)
    assert sum(v.numel() for v in sent.values()) < full / 10


def test_a_resumed_lora_run_takes_the_same_step(embedded_path, tmp_path):
    """Dropout on (the RNG state is part of the checkpoint): step 2 after a resume from the
    checkpoint of step 1 gives the adapters of step 2 without one, bit for bit."""
    from asyncrl.rl.checkpoint import list_checkpoints

    first, second = random_groups(seed=1), random_groups(seed=2)
    a = trainer(embedded_path, dropout=0.1)
    a.train_share(first)
    path = asyncio.run(a.save_checkpoint(str(tmp_path), 1, 2, b"{}"))
    saved = set(os.listdir(os.path.join(path, "model")))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved and "model.safetensors" not in saved
    a.train_share(second)
    b = trainer(embedded_path, dropout=0.1)
    assert asyncio.run(b.load_checkpoint(list_checkpoints(str(tmp_path))[-1].path)) == 1
    b.train_share(second)
    want, got = adapter_tensors(a.model), adapter_tensors(b.model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not any(p.requires_grad for n, p in b.model.named_parameters() if n not in got)  # the base stays frozen


def test_the_final_export_is_a_merged_checkpoint_and_the_adapter(embedded_path, tmp_path):
    from asyncrl.rl.model.lora import load_adapter
    from asyncrl.rl.model.policy import load_policy

    t = trainer(embedded_path)
    t.train_share(random_groups(seed=1))
    out = asyncio.run(t.save(str(tmp_path / "final")))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    t.model.eval()
    with torch.no_grad():
        want = t.model(input_ids=ids).logits
        merged, _, _ = load_policy(out)  # plain transformers, as vLLM would load it: no peft needed
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        base, _, _ = load_policy(embedded_path)
        adapted = load_adapter(base, os.path.join(out, "adapter"), trainable=False)  # peft's PeftModel.from_pretrained
        assert torch.equal(adapted(input_ids=ids).logits, want)


def test_adapter_only_sync_into_vllm_is_refused_only_past_vllms_ranks():
    for backend in ("auto", "vllm", "hf"):
        GRPOConfig(
            trainer=TrainerConfig(lora=LoRAConfig(rank=8, sync="adapter")), sampler=SamplerConfig(backend=backend)
        )
    wide = TrainerConfig(lora=LoRAConfig(rank=1024, sync="adapter"))
    with pytest.raises(ConfigError, match="vLLM serves LoRA ranks up to 512"):
        GRPOConfig(trainer=wide, sampler=SamplerConfig(backend="auto"))
    GRPOConfig(trainer=wide, sampler=SamplerConfig(backend="hf"))


def test_bad_lora_settings_are_refused():
    with pytest.raises(ValueError, match="sync must be one of"):
        LoRAConfig(rank=4, sync="deltas")
    with pytest.raises(ValueError, match="rank must be >= 0"):
        LoRAConfig(rank=-1)


def test_lora_steps_move_the_policy_toward_the_rewarded_completions(embedded_path):
    """Learning through the adapters alone: repeated steps on the same groups raise the log-prob of
    each group's best completion against its worst (the base never moves)."""
    from asyncrl.rl.scoring.tokens import token_logprobs
    from asyncrl.rl.trainer.batching import micro_batches
    from asyncrl.rl.trainer.loss import group_advantages

    groups = random_groups(seed=4, multi_turn=False)
    t = trainer(embedded_path, sync="adapter")
    base = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}

    def margin() -> float:  # mean over groups of (best completion's mean log-prob - worst's)
        with torch.no_grad():
            total = 0.0
            for g in groups:
                (b,) = micro_batches([g], group_advantages([list(g.rewards)]), 10_000, torch.device("cpu"))
                lp = b.scored(
                    token_logprobs(t.model(input_ids=b.input_ids, attention_mask=b.attention).logits, b.input_ids)
                )
                means = (lp * b.mask).sum(1) / b.mask.sum(1)
                order = sorted(range(len(g.rewards)), key=lambda i: len(g.prompt_ids) + len(g.completion_ids[i]))
                by_seq = {order[i]: float(means[i]) for i in range(len(order))}  # rows are sorted by length
                best, worst = (
                    max(range(len(g.rewards)), key=g.rewards.__getitem__),
                    min(range(len(g.rewards)), key=g.rewards.__getitem__),
                )
                total += by_seq[best] - by_seq[worst]
            return total / len(groups)

    before = margin()
    for _ in range(5):
        t.train_share(groups)
    assert margin() > before + 0.1  # measured: 0.002 -> 0.224
    assert all(torch.equal(p, base[n]) for n, p in t.model.named_parameters() if n in base)


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_a_tiny_lora_run_of_the_example_syncs_and_exports(tmp_path, sync, model_cache):
    """The example end to end with LoRA (the HF sampler): every step trains and syncs, and the
    final policy is a merged checkpoint that transformers loads, with the adapter beside it."""
    import json

    from transformers import AutoModelForCausalLM

    from test_grpo import TINY, launch

    run_dir = tmp_path / "run"
    done = launch(
        tmp_path,
        *TINY,
        "--trainer.lora.rank",
        "4",
        "--trainer.lora.sync",
        sync,
        "--trainer.lr",
        "1e-3",
        "--run.run_dir",
        str(run_dir),
        cache=model_cache,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["sync_s"] > 0 for r in records)
    assert json.loads((run_dir / "config.json").read_text())["trainer"]["lora"]["sync"] == sync
    final = run_dir / "final"
    assert (final / "adapter" / "adapter_config.json").exists()
    assert AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True).config.hidden_size == 32


def test_a_lora_run_of_the_example_raises_the_reward(tmp_path, model_cache):
    """The example with LoRA adapters (adapter-only sync into the HF sampler) on a task GRPO can
    learn in a few steps on the tiny model: the reward rises, as it does with full fine-tuning
    (test_user_task.py)."""
    import json

    from test_user_task import HERE, launch

    run_dir = tmp_path / "run"
    done = launch(
        tmp_path,
        "--task.name",
        f"{HERE}:YesNo",
        "--run.steps",
        "12",
        "--run.groups_per_step",
        "8",
        "--sampler.group_size",
        "8",
        "--trainer.lora.rank",
        "4",
        "--trainer.lora.sync",
        "adapter",
        "--trainer.lr",
        "5e-3",
        "--warm_start.steps",
        "80",
        "--warm_start.lr",
        "1e-2",
        "--warm_start.warmup_steps",
        "5",
        "--warm_start.batch_size",
        "32",
        "--run.eval_every",
        "12",
        "--run.run_dir",
        str(run_dir),
        cache=model_cache,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rewards = [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # measured: 0.64 over the first three steps, 0.81 over the last three; 1e-2 collapses (full FT too)
    assert len(rewards) == 12 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_the_kl_reference_under_lora_is_the_base_with_the_adapters_off_not_a_copy(embedded_path):
    from asyncrl.rl.config.trainer import GRPOLossConfig
    from asyncrl.rl.model.policy import load_policy
    from asyncrl.rl.scoring.forward import policy_logits
    from asyncrl.rl.scoring.tokens import token_logprobs
    from asyncrl.rl.trainer.actor import TrainerActor
    from asyncrl.rl.trainer.batching import micro_batches
    from asyncrl.rl.trainer.loss import group_advantages

    torch.set_num_threads(1)
    t = TrainerActor(embedded_path, TrainerConfig(lr=1e-2, lora=LoRAConfig(rank=4), loss=GRPOLossConfig(kl_coef=0.1)))
    assert t.policy.ref is None  # no second copy of the model
    groups = random_groups(seed=2, multi_turn=False)
    assert t.train_share(groups).kl == pytest.approx(0.0, abs=1e-9)  # fresh adapters: the policy is the base
    t.train_share(groups)
    batch = micro_batches(groups, group_advantages([list(g.rewards) for g in groups], False), 1 << 20, t.device)[0]
    with torch.no_grad():
        with t.policy.reference() as reference:
            ref = token_logprobs(policy_logits(reference, batch), batch.input_ids)
        policy = token_logprobs(policy_logits(t.model, batch), batch.input_ids)  # the adapters are back on
    base = load_policy(embedded_path)[0].eval()
    with torch.no_grad():
        expected = token_logprobs(policy_logits(base, batch), batch.input_ids)
    assert torch.allclose(ref, expected, atol=1e-5)
    assert (policy - expected).abs().max() > 1e-3  # the trained adapters move the policy away from it
    assert t.train_share(groups).kl > 0
