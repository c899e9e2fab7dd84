"""What the vLLM tests share (tests/test_vllm_backend.py, test_vllm_actor.py, test_multiturn_vllm.py):
the device the installed vLLM build runs on and how an engine there is configured, the
``vllm_required`` fixture, an in-process ``engine`` on the tiny checkpoint,
a log-prob reference in a chosen dtype, and a trainer stand-in that sends the sampler's own
weights, or changed ones.

The tests run on either build: vLLM's CPU build on CPU, its CUDA build on the first GPU. Where vLLM
is not installed they skip, unless ``ASYNCRL_REQUIRE_VLLM=1`` (set by .ci/run): then they fail, so
CI can never pass by skipping them. Test modules load this one as a plugin
(``pytest_plugins = ["vllm_support"]``) for those fixtures.
"""

from __future__ import annotations

import asyncio
import functools
import os

import pytest
import pytest_asyncio
import torch

from asyncrl import endpoint
from asyncrl.comm.member import SyncMember
from asyncrl.comm.weights import WeightSender

# One OpenMP thread per process on the shared 2-core machine; a small KV cache; vLLM's CPU
# threads not pinned to cores (other processes share them); the model's worker inside the engine
# core's process (vLLM's one-process executor, as on a GPU at tensor parallel 1), where the CPU
# build would start a process of its own for it: one vLLM import less an engine (about 11 s of a
# 40-s start on two cores), and a shutdown that does not wait on a second process (one took 4 s
# under the suite's load and the engine core outlived vLLM's 5-s grace). The CPU build's own
# multi-process executor keeps one test: the supervisor's SIGKILL in test_vllm_actor.py.
VLLM_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TQDM_DISABLE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
MULTIPROCESS_EXECUTOR = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
"""vLLM's CPU build's default: its model worker in a process of its own (shared-memory queues to it)."""
SYNC_BACKEND = "gloo"
"""The weight-sync backend of these tests: the trainer stand-in holds its weights on the CPU, and
a one-GPU machine cannot give NCCL two ranks on one GPU."""


@functools.cache
def vllm_device() -> tuple[torch.device | None, str]:
    """(the device the installed vLLM build samples on, "") or (None, why none)."""
    from asyncrl.rl.sampler.vllm.engine_setup import vllm_unusable

    why_cpu = vllm_unusable(torch.device("cpu"))
    if not why_cpu:
        return torch.device("cpu"), ""
    if torch.cuda.is_available() and not vllm_unusable(torch.device("cuda")):
        return torch.device("cuda", 0), ""
    return None, why_cpu


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_path, policy, vllm_required):
    """A `VLLMBackend` in this process on the tiny checkpoint (modules that use it also load the
    ``sampler_support`` plugin for tiny_path and policy), shared by a module's tests."""
    from asyncrl.rl.sampler.vllm.backend import VLLMBackend

    b = VLLMBackend(
        tiny_path,
        tokenizer=policy[1],
        seed=0,
        device=vllm_required,
        engine=engine_options(vllm_required),
        engine_stats=True,  # the module's tests run with the engine's statistics kept and counted
    )
    yield b
    b.close()
    # Its processes ended within vLLM's 5 s grace, not by its SIGKILL after (engine_exit.py).
    assert b.engine_exit_codes == [0], f"vLLM's engine core ended with {b.engine_exit_codes}, not by itself"


def engine_options(device: torch.device) -> dict:
    """``VLLMBackend(engine=...)`` for the tests. float32 on both builds: the reference the
    log-probs are checked against is the fp32 HF model (compare like with like; the bf16 path has
    its own GPU test). On a GPU: a small share of its memory, so an engine still shutting down
    leaves room for the next, and fewer batch sizes to capture as CUDA graphs."""
    options = {"max_model_len": 512, "dtype": "float32", "max_num_seqs": 64}
    if device.type == "cuda":
        options["gpu_memory_utilization"] = 0.15
    return options


def running_s(device: torch.device, cpu_s: float) -> float:
    """How long to wait for a request for a few hundred tokens to have surely begun and not yet
    finished: ``cpu_s`` on the CPU; a GPU decodes the tiny model's 400 tokens in about a second."""
    return 0.05 if device.type == "cuda" else cpu_s


def repeat_abs(device: torch.device) -> float:
    """How far the log-probs of one computation done twice may differ (the second time from the
    prefix cache, say): on a GPU vLLM's fp32 attention kernel (Triton) multiplies in TF32."""
    return 1e-3 if device.type == "cuda" else 1e-4


def needs_two_devices(device: torch.device) -> str:
    """Why a whole GRPO run (a trainer and a vLLM sampler, each on a device of its own) cannot run
    here ("" when it can): on a GPU it needs two until samplers can share the trainer's GPU."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return "a GRPO run on vLLM's CUDA build needs a GPU for the trainer and one for the sampler"
    return ""


@pytest.fixture(scope="module")
def vllm_required() -> torch.device:
    """The device of the installed vLLM build; skips (or fails, see the module docstring) without one."""
    device, why = vllm_device()
    if device is None:
        if os.environ.get("ASYNCRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"ASYNCRL_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)
    env = dict(VLLM_ENV)
    if device.type == "cuda":
        # Engines started in this process must be spawned: one forked after this process touched
        # the GPU (a second engine here did) cannot initialise CUDA.
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the in-process engine's core process inherits these
    yield device
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits[t-1] / T)[token_t] of one forward over prompt + completion by ``model``
    (an HF model on the CPU, in its own dtype), its logits taken to fp32 first, as vLLM does."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    scored = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)] / temperature  # causal shift
    return torch.log_softmax(scored, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


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
        self.sender = await asyncio.to_thread(
            WeightSender.create, self.sync_comm, self.sync_group, self.live, timeout_s=timeout_s, bucket_bytes=64 << 10
        )
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
