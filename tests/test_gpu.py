"""Device placement on a real GPU host (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

from asyncrl import NoFreeDevicesError, Supervisor
from asyncrl.runtime.devices import detect
from tensor_actors import CudaUser

kind, ids = detect("auto")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(kind != "cuda" or not ids, reason="no CUDA device on this host")]


async def test_each_actor_sees_only_its_own_gpus():
    async with Supervisor(device_kind="cuda") as sup:
        group = await sup.spawn_group(CudaUser, len(ids), name="gpu", gpus=1)
        seen = [await h.visible() for h in group]
        assert [count for count, _ in seen] == [1] * len(ids)
        assert sorted(v for _, v in seen) == sorted(ids)
        out = await group[0].on_device(torch.arange(4.0))
        assert out.device.type == "cpu" and out.tolist() == [0.0, 2.0, 4.0, 6.0]
        with pytest.raises(NoFreeDevicesError):
            await sup.spawn(CudaUser, gpus=1)
        cpu_only = await sup.spawn(CudaUser)
        assert await cpu_only.visible() == (0, "")


def test_an_actors_gpu_is_its_cuda_0_without_cudnn_attention():
    # cuDNN's attention builds a plan for every new shape (benchmarks/README.md, "Attention on new shapes")
    from asyncrl.rl.actor_device import actor_device

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert actor_device("cuda") == torch.device("cuda", 0) == torch.device("cuda", torch.cuda.current_device())
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("multi, bias", [(False, False), (True, True)], ids=["sampled", "top-k-bias"])
def test_the_fused_head_s_cuda_fast_path_gives_the_eager_path_s_values(monkeypatch, multi, bias):
    """``scoring/chunked_head.py`` on CUDA, bf16: compiled chunk functions and the float32
    accumulation inside the matmul against ``ASYNCRL_HEAD_FAST=0``'s eager path (ragged chunks)."""
    import torch._inductor.config as inductor_config

    from asyncrl.rl.scoring import chunked_head
    from asyncrl.rl.scoring.chunked_head import head_logprobs

    # compile here, not in Inductor's pool of worker processes, which would outlive the test
    monkeypatch.setattr(inductor_config, "compile_threads", 1)

    assert chunked_head._fp32_matmul(torch.device("cuda"), torch.bfloat16) in ("addmm", "mm")  # torch >= 2.8
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, vocab, width = 1000, 5003, 64
    hidden = torch.randn(n, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(vocab, width, device="cuda", generator=gen)).bfloat16().requires_grad_()
    b = torch.randn(vocab, device="cuda", generator=gen).bfloat16().requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (n, 4) if multi else (n,), device="cuda", generator=gen)
    upstream = torch.randn(targets.shape, device="cuda", generator=gen)
    inputs = [t for t in (hidden, weight, b) if t is not None]

    def run(fast: bool):
        monkeypatch.setattr(chunked_head, "FAST", fast)
        lp, ent = head_logprobs(hidden, weight, b, targets, 0.7, compute_dtype=torch.bfloat16, chunk=300, entropy=True)
        return lp.detach(), ent, torch.autograd.grad(lp, inputs, grad_outputs=upstream)

    lp, ent, grads = run(True)
    lp0, ent0, grads0 = run(False)
    torch.testing.assert_close(lp, lp0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, ent0, rtol=1e-4, atol=1e-4)
    for g, g0 in zip(grads, grads0):  # bf16 dz either way; grad_w summed in float32 without a bf16 product
        assert g.dtype == g0.dtype and g0.abs().max() > 1e-3
        torch.testing.assert_close(g.float(), g0.float(), rtol=2e-2, atol=2e-2 * g0.abs().max().item())


def test_the_warm_start_trains_on_the_gpu_and_is_cached_under_its_model(tmp_path):
    import json
    import os

    from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
    from asyncrl.rl.model.warm_start import cache_key, default_model

    model = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=64
    )
    warm = WarmStartConfig(
        steps=30, batch_size=64, warmup_steps=2, n_examples=256, heldout_reserve=16, eval_problems=8, device="auto"
    )
    lines: list[str] = []
    path = default_model(model, warm, cache_dir=str(tmp_path), log=lines.append, run_device="cuda")
    on_cpu = default_model(model, warm, cache_dir=str(tmp_path), log=lambda _: None)  # the same start, in fp32
    where = f"cuda:{torch.cuda.get_device_name(0)}"
    assert os.path.basename(path) == cache_key(model, warm, None, where) != cache_key(model, warm)
    assert os.path.basename(on_cpu) == cache_key(model, warm)
    markers = []
    for built in (path, on_cpu):
        with open(os.path.join(built, "asyncrl_model.json")) as f:
            markers.append(json.load(f))
    assert [m["trained_on"] for m in markers] == [where, "cpu"]
    # 30 steps from ln(vocabulary) = 5.6 to about 3.1 on the CPU: the GPU trains the same model
    assert abs(markers[0]["final_loss"] - markers[1]["final_loss"]) < 0.05, markers
    assert any(f"on {where}" in line for line in lines), lines


async def test_staged_receivers_on_the_senders_gpu_take_syncs_over_cuda_ipc_alone_and_apply_bit_exactly():
    """--sampler.stage_weights with the samplers colocated: two receivers share the sender's GPU
    (CUDA IPC) and take every sync after the first on the sender's notice (`staged_rounds`)."""
    from asyncrl.comm.member import form_group
    from sync_actors import Receiver, Sender, staged_rounds

    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, kwargs={"device": "cuda"}, name="sender", gpus=1)
        first = await sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="first", share_devices_with="sender")
        second = await sup.spawn(Receiver, 3, kwargs={"device": "cuda"}, name="second", share_devices_with="sender")
        await form_group([sender, first, second], "127.0.0.1", backend="ipc", timeout_s=60)
        await staged_rounds(sender, [first, second])
