"""Adapter-only LoRA sync into vLLM (``sampler/vllm/adapter.py``): a trainer, a vLLM sampler and
an HF sampler in one weight-sync group over gloo. The adapters arrive bit for bit in both; vLLM,
serving them through its own LoRA path, generates what the HF sampler (peft) generates, with the
same log-probs (fp32 both); a sync makes a new adapter and the one before is released.

Where vLLM is not installed these tests skip, unless ``ASYNCRL_REQUIRE_VLLM=1`` (see vllm_support).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("peft")

from asyncrl import Supervisor  # noqa: E402
from asyncrl.comm.member import form_group  # noqa: E402
from asyncrl.rl.config.run import DataConfig  # noqa: E402
from asyncrl.rl.config.sampler import SamplerConfig  # noqa: E402
from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig  # noqa: E402
from asyncrl.rl.generation import SamplingParams  # noqa: E402
from sampler_support import HOST, N_HELDOUT, N_TRAIN  # noqa: E402
from test_packing import random_groups  # noqa: E402
from vllm_support import VLLM_ENV, engine_options  # noqa: E402

pytest_plugins = ["sampler_support", "vllm_support"]  # fixtures: tiny_path, policy; vllm_required

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("actor_zygote")]  # tests/conftest.py: forked actors


def test_an_fp32_engine_on_a_gpu_is_refused_adapters_before_it_starts():
    from asyncrl.rl.sampler.vllm.adapter import lora_dtype_refusal

    assert "fp16 or bf16 only" in lora_dtype_refusal("float32", "cuda")
    assert "fp16 or bf16 only" in lora_dtype_refusal(torch.float32, "cuda")
    assert lora_dtype_refusal("auto", "cuda") == lora_dtype_refusal("bfloat16", "cuda") == ""
    assert lora_dtype_refusal("float32", "cpu") == ""  # the CPU build's LoRA path takes fp32


async def test_adapters_reach_vllm_bit_for_bit_and_it_samples_as_peft_does(tiny_path, policy, vllm_required):
    if vllm_required.type == "cuda":
        pytest.skip(
            "compares vLLM with fp32 peft, and vLLM's GPU LoRA kernels take bf16/fp16 only: the CPU "
            "build's test; on a GPU the adapter path ran in a GRPO run (docs/lora.md)"
        )
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout
    from asyncrl.rl.trainer.actor import TrainerActor

    lora = LoRAConfig(rank=4, alpha=32.0, sync="adapter")
    data = DataConfig(n_train=N_TRAIN, n_heldout=N_HELDOUT)
    config = dict(group_size=2, max_new_tokens=12, weight_update="pause")
    _, _, fmt = policy
    train, _ = train_and_heldout(0, N_TRAIN, N_HELDOUT)
    probe = [fmt.render_ids(Countdown().prompt(p)) for p in train[:3]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    async with Supervisor(call_timeout_s=120, start_timeout_s=240) as sup:
        trainer, vllm, hf = await asyncio.gather(
            sup.spawn(
                TrainerActor, tiny_path, TrainerConfig(lr=5e-2, lora=lora), name="trainer", env={"OMP_NUM_THREADS": "1"}
            ),
            sup.spawn(
                SamplerActor,
                tiny_path,
                SamplerConfig(backend="vllm", **config),
                name="vllm",
                env=VLLM_ENV,
                gpus=int(vllm_required.type == "cuda"),
                kwargs=dict(
                    adapter=lora, data=data, device=str(vllm_required), vllm={"engine": engine_options(vllm_required)}
                ),
            ),
            sup.spawn(
                SamplerActor,
                tiny_path,
                SamplerConfig(backend="hf", **config),
                name="hf",
                env={"OMP_NUM_THREADS": "1"},
                kwargs=dict(adapter=lora, data=data),
            ),
        )
        await form_group([trainer, vllm, hf], HOST, timeout_s=60)
        await asyncio.gather(trainer.setup_sender(30), vllm.setup_receiver(30), hf.setup_receiver(30))
        base = await vllm.generate(probe, 1, greedy)
        assert [g[0].token_ids for g in base] == [g[0].token_ids for g in await hf.generate(probe, 1, greedy)]

        for version in (1, 2):
            for seed in range(3):  # a few steps, so B is far from 0
                await trainer.train_step(random_groups(seed=10 * version + seed))
            await asyncio.gather(
                trainer.send_weights(version), vllm.receive_weights(version), hf.receive_weights(version)
            )
            want = await trainer.weights_digest()
            assert await vllm.weights_digest() == want == await hf.weights_digest()  # the adapters, bit for bit
            ours, theirs = await asyncio.gather(vllm.generate(probe, 1, greedy), hf.generate(probe, 1, greedy))
            assert [g[0].token_ids for g in ours] == [g[0].token_ids for g in theirs], version
            assert [lp for g in ours for lp in g[0].logprobs] == pytest.approx(
                [lp for g in theirs for lp in g[0].logprobs], abs=2e-3
            )
            assert (await vllm.stats()).loaded_adapters == 1  # the one before was released
        assert [g[0].token_ids for g in ours] != [g[0].token_ids for g in base]  # the adapters do change it
        groups = [g async for g in vllm.rollouts(2)]
        assert [g.version for g in groups] == [2, 2]
