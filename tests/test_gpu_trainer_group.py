"""An FSDP2 trainer of 2 ranks on two real GPUs (NCCL between the ranks) against one rank on one GPU,
as tests/test_trainer_group.py checks them with gloo on the CPU:

* the same batch gives the same gradients: in fp32 to 1e-5 absolute / 1e-4 relative (the CPU's
  tolerance), and with bf16 (parameters gathered in bf16, gradients reduced in fp32, against one
  rank's bf16 autocast) to 2% of each gradient's norm: bf16 keeps 8 bits of mantissa (0.4%), and
  the two round at different points (FSDP2 casts the parameters; autocast casts at each matmul);
* a rank SIGKILLed in the middle of a backward ends the step on the other rank within the same
  15 s as on the CPU, naming the dead rank: NCCL's spinning kernel is aborted, not waited out."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig
from asyncrl.runtime.devices import detect
from asyncrl.runtime.supervisor import Supervisor
from tests.sampler_support import write_tiny
from tests.test_trainer_group import HOST, batch

ON_GPU = {"device": "cuda"}  # the trainer computes on the CPU unless told (a GRPO run tells it)
kind, ids = detect("auto")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(kind != "cuda" or len(ids) < 2, reason="needs two CUDA devices"),
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return write_tiny(str(tmp_path_factory.mktemp("tiny")))


async def spawn_ranks(sup, path, config, env=None):
    from asyncrl.rl.driver.fleet.trainer_ranks import spawn_trainer_ranks

    config = dataclasses.replace(config, world_size=2)
    return await spawn_trainer_ranks(
        sup, path, config, timeout_s=120.0, gpus=1, env=env or {}, options=ON_GPU, host=HOST
    )


@pytest.mark.parametrize(
    "bf16,features",
    [(False, {}), (True, {}), (False, {"pack_tokens": 40}), (False, {"lora": LoRAConfig(rank=4)})],
    ids=["fp32", "bf16", "fp32-packed", "fp32-lora"],
)
def test_two_gpu_ranks_compute_the_gradient_one_gpu_computes(tiny_path, bf16, features):
    from asyncrl.rl.trainer.actor import TrainerActor

    config = TrainerConfig(micro_batch_tokens=40, grad_clip=0.0, bf16=bf16, compile=False, **features)
    data = batch(1)

    async def main():
        async with Supervisor(call_timeout_s=180, device_kind="cuda") as sup:
            plain = await sup.spawn(TrainerActor, tiny_path, config, name="plain", gpus=1, kwargs=ON_GPU)
            one = await plain.train_step(data)
            g1 = await plain.gradients()
        async with Supervisor(call_timeout_s=180, device_kind="cuda") as sup:  # the two ranks take both GPUs
            ranks = await spawn_ranks(sup, tiny_path, config)
            two = await ranks.with_timeout(180).train_step(data)
            return one, two, g1, await ranks.with_timeout(60).gradients()

    one, two, g1, g2 = asyncio.run(main())
    assert (one.peak_mem_gib or 0) > 0 and (two.peak_mem_gib or 0) > 0  # reported on a GPU only
    assert set(g1) == set(g2) and len(g1) > 5
    assert max(float(g.abs().max()) for g in g1.values()) > 1e-4  # not trivially equal
    for name in g1:
        a, b = g1[name].float(), g2[name].float()
        if bf16:
            assert float((a - b).norm()) <= 0.02 * float(a.norm()) + 1e-6, (
                name,
                float((a - b).norm()),
                float(a.norm()),
            )
        else:
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (name, float((a - b).abs().max()))
    for key in ("loss", "pg_loss", "tokens", "sequences"):
        assert two[key] == pytest.approx(one[key], rel=2e-2 if bf16 else 1e-4, abs=1e-6), key


def test_a_gpu_rank_killed_mid_backward_ends_the_step_on_the_other_naming_it(tiny_path):
    from asyncrl.errors import ActorDiedError
    from asyncrl.rl.trainer.parallel import FAULT_ENV

    async def main():
        async with Supervisor(call_timeout_s=180, device_kind="cuda") as sup:
            ranks = await spawn_ranks(
                sup, tiny_path, TrainerConfig(micro_batch_tokens=40, compile=False), env={FAULT_ENV: "1:2:hang"}
            )
            await ranks.with_timeout(120).train_step(batch(3))
            step = asyncio.ensure_future(ranks.with_timeout(120).train_step(batch(4)))
            await asyncio.sleep(5.0)  # rank 1 is frozen mid-backward; rank 0 waits in a collective
            assert not step.done()
            ranks.handles[1].kill("test: SIGKILL mid-step")
            start = time.monotonic()
            with pytest.raises(BaseException) as info:
                await step
            return info.value, time.monotonic() - start

    error, left = asyncio.run(main())
    print(f"the step ended {left:.1f} s after rank 1 was killed: {error}")  # shown with -rP
    assert isinstance(error, ActorDiedError) and "trainer rank 1" in str(error), error
    assert left < 15.0
