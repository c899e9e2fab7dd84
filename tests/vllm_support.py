"""What the vLLM tests share (tests/test_vllm_backend.py, test_vllm_actor.py): the environment of
an engine on a shared 2-core machine, the ``vllm_required`` fixture, and a trainer stand-in that
sends the sampler's own weights, or changed ones.

Where vLLM is not installed the vLLM tests skip, unless ``ASYNCRL_REQUIRE_VLLM=1`` (set by .ci/run):
then they fail, so CI can never pass by skipping them. Test modules load this one as a plugin
(``pytest_plugins = ["vllm_support"]``) for that fixture.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from asyncrl import endpoint
from asyncrl.comm.member import SyncMember
from asyncrl.comm.weights import WeightSender

# One OpenMP thread per process on the shared 2-core machine; a small KV cache; vLLM's CPU
# threads not pinned to cores (other processes share them).
VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "TQDM_DISABLE": "1"}
ENGINE = {"max_model_len": 512}


@pytest.fixture(scope="module")
def vllm_required():
    from asyncrl.rl.sampler.vllm.backend import vllm_unusable

    why = vllm_unusable(torch.device("cpu"))
    if why:
        if os.environ.get("ASYNCRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"ASYNCRL_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)  # the in-process engine's core process inherits these
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class StatePusher(SyncMember):
    """Trainer stand-in: holds named weights (from safetensors files) and sends one of them."""

    def __init__(self, files: dict[str, str]):
        from safetensors.torch import load_file

        self.states = {key: load_file(path) for key, path in files.items()}
        first = next(iter(self.states.values()))
        self.live = {name: t.clone() for name, t in first.items()}
        self.sender: WeightSender | None = None

    @endpoint
    async def setup(self, timeout_s: float = 30.0) -> int:
        self.sender = await asyncio.to_thread(WeightSender.create, self.sync_comm, self.sync_group, self.live,
                                              timeout_s=timeout_s, bucket_bytes=64 << 10)
        return len(self.sender.layout.buckets)

    @endpoint
    async def send(self, version: int, which: str) -> float:
        for name, t in self.live.items():
            t.copy_(self.states[which][name])
        return (await asyncio.to_thread(self.sender.send, version)).seconds


def state_files(model, path: str) -> dict[str, str]:
    """The sampler's own weights and changed ones, named as the trainer's named_parameters."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    original = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    changed = {n: (t + 0.5 * torch.randn(t.shape, generator=g)).contiguous() for n, t in original.items()}
    files = {}
    for key, state in (("original", original), ("changed", changed)):
        files[key] = os.path.join(path, f"{key}.safetensors")
        save_file(state, files[key])
    return files
