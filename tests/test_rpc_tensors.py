"""Tensors and arrays through real actor calls, over ipc and tcp."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl import InvalidArgumentsError, Supervisor
from tensor_actors import Tensors

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its actors (torch imported) forked


@pytest.fixture(params=["ipc", "tcp"])
async def actor(request):
    async with Supervisor(transport=request.param) as sup:
        yield await sup.spawn(Tensors)


async def test_tensors_of_every_kind_roundtrip(actor):
    cases = [
        torch.randn(3, 4),
        torch.tensor(2.5),
        torch.empty(0, 7),
        torch.randn(64, 32).t(),
        torch.randn(1000).to(torch.bfloat16),
        torch.randint(0, 255, (513,), dtype=torch.uint8),
        torch.ones(300, dtype=torch.bool),
        torch.randn(40, dtype=torch.complex64),
        torch.randn(200).to(torch.float8_e4m3fn),
    ]
    out = await actor.echo_many(cases)
    for sent, got in zip(cases, out, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.contiguous().reshape(-1).view(torch.uint8))


async def test_numpy_arrays_roundtrip(actor):
    a = np.random.default_rng(0).standard_normal((17, 9)).astype(np.float16)
    got = await actor.echo_array(a)
    assert got.dtype == np.float16 and np.array_equal(got, a)


async def test_large_tensor_both_ways(actor):
    t = torch.randn((16 << 20) // 4)  # 16 MiB
    assert await actor.nbytes(t) == 16 << 20
    assert await actor.checksum(t) == pytest.approx(float(t.double().sum()))
    made = await actor.make(1 << 20)
    assert torch.equal(made, torch.arange(1 << 20, dtype=torch.float32))


async def test_tensor_annotation_is_enforced(actor):
    with pytest.raises(InvalidArgumentsError, match="Expected `Tensor`, got `list` - at `t`"):
        await actor.echo([1.0, 2.0])
    with pytest.raises(InvalidArgumentsError, match="Expected `ndarray`, got `Tensor` - at `a`"):
        await actor.echo_array(torch.ones(3))
    assert torch.equal(await actor.echo(torch.ones(3)), torch.ones(3))
