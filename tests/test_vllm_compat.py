"""The vLLM releases asyncrl supports and the calls that differ between them (``vllm/compat.py``),
on stand-ins for the two forms each call takes. These run everywhere, vLLM installed or not;
the real engine runs them in tests/test_vllm_backend.py and test_vllm_actor.py.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from asyncrl.rl.sampler.vllm import compat


@pytest.mark.parametrize(
    "version, problem",
    [
        ("0.24.0", ""),
        ("0.32.0", ""),
        ("0.32.0+cpu", ""),
        ("0.33.1rc1.dev5+g1234", ""),
        ("1.0.0", ""),
        ("0.23.1", "older than 0.24"),
        ("0.9.2", "older than 0.24"),
        ("dev", "cannot read"),
    ],
)
def test_the_supported_range_starts_at_0_24(version, problem):
    found = compat.version_problem(version)
    assert (problem in found) if problem else found == "", found


def test_a_release_newer_than_the_newest_checked_warns_once():
    compat.warn_if_newer.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.warn_if_newer("0.33.0")  # the newest checked: silent
        compat.warn_if_newer("0.34.0")
        compat.warn_if_newer("0.34.0")  # once per process and release
    assert [str(w.message)[:40] for w in caught] == ["vLLM 0.34.0 is newer than 0.33, the newe"]


def test_unfinished_requests_on_either_form_of_the_engine():
    class Processor:
        def get_num_unfinished_requests(self):
            return 3

    class Engine024:  # 0.24: only the output processor counts them
        output_processor = Processor()

    class Engine032(Engine024):  # 0.32+: AsyncLLM has the method
        def get_num_unfinished_requests(self):
            return 5

    assert compat.unfinished_requests(Engine024()) == 3
    assert compat.unfinished_requests(Engine032()) == 5


def test_the_live_model_is_the_runners_unwrapped_one():
    model = torch.nn.Linear(2, 2)

    class Wrapper:  # 0.24's V1 runner may hold the model in a CUDA-graph wrapper
        def __init__(self, runnable):
            self.runnable = runnable

    class Runner:
        def __init__(self, model):
            self.model = Wrapper(model)

        def get_model(self):
            return self.model.runnable

    assert compat.live_model(Runner(model)) is model


def test_without_flashinfer_the_cuda_engine_samples_with_pytorch():
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    assert compat.engine_environment("cpu") == {}
    assert compat.engine_environment("cuda") == ({} if has_flashinfer else {"VLLM_USE_FLASHINFER_SAMPLER": "0"})


def test_the_engine_is_sized_for_batch_generation(monkeypatch):
    """``AsyncLLM.from_engine_args`` by default sizes the engine as one behind a server (128
    sequences a step); the sampler asks for the ``LLM`` class's sizes."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    seen = {}
    monkeypatch.setattr(
        AsyncLLM, "from_engine_args", classmethod(lambda cls, args, **kw: seen.update(model=args.model, **kw))
    )
    compat.make_engine({"model": "/nonexistent", "seed": 3})
    assert seen == {"model": "/nonexistent", "usage_context": UsageContext.LLM_CLASS}


def test_the_sampled_tokens_logprobs_from_flat_or_per_position_logprobs():
    class Logprob:
        def __init__(self, logprob):
            self.logprob = logprob

    class Flat(list):  # as vLLM's FlatLogprobs: a sequence of positions, plus the flat lists
        def __init__(self, token_ids, logprobs):
            super().__init__({t: Logprob(v)} for t, v in zip(token_ids, logprobs))
            self.token_ids, self.logprobs = token_ids, logprobs

    ids = [5, 7, 5]
    assert compat.sampled_logprobs(Flat(ids, [-1.0, -2.0, -0.5]), ids) == [-1.0, -2.0, -0.5]
    assert compat.sampled_logprobs(
        [{5: Logprob(-1.0)}, {7: Logprob(-2.0), 1: Logprob(-0.1)}, {5: Logprob(-0.5)}], ids
    ) == [-1.0, -2.0, -0.5]
    assert compat.sampled_logprobs([{5: Logprob(-1.0)}, {8: Logprob(-2.0)}, {5: Logprob(-0.5)}], ids) is None
    assert compat.sampled_logprobs(Flat(ids[:2], [-1.0, -2.0]), ids) is None
    assert compat.sampled_logprobs(None, ids) is None
    if importlib.util.find_spec("vllm") is not None:  # the real container, as the output processor fills it
        from vllm.logprobs import FlatLogprobs
        from vllm.logprobs import Logprob as VLogprob

        flat = FlatLogprobs()
        for t, v in zip(ids, [-1.0, -2.0, -0.5]):
            flat.append({t: VLogprob(v, rank=1)})
        assert compat.sampled_logprobs(flat, ids) == [-1.0, -2.0, -0.5]
