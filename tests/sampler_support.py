"""What the sampler tests share (tests/test_sampler.py, tests/test_vllm_*.py): a tiny random Qwen2
checkpoint with the project's tokenizer, the HF policy loaded from it, a few Countdown prompts of
different lengths, the log-prob recomputation both backends are checked against, and a scripted
three-turn environment.

Test modules load this one as a plugin (``pytest_plugins = ["sampler_support"]``) for its
fixtures; they are module-scoped, so each test module builds its own checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from asyncrl.rl.tasks.base import Environment, Reply

HOST = "127.0.0.1"
# A tiny model gains nothing from a second intra-op thread, and on a shared 2-core machine three
# processes spinning two OpenMP threads each run several times slower.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
N_TRAIN, N_HELDOUT = 50, 10


def write_tiny(path: str, hidden_size: int = 64) -> str:
    """A random Qwen2 checkpoint (2 layers, ``hidden_size`` wide) with the project's tokenizer,
    loadable by load_policy, written to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump({"prompt_style": "compact", "max_new_tokens_hint": 24}, f)
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    """The 64-wide `write_tiny` checkpoint."""
    return write_tiny(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def policy(tiny_path):
    from asyncrl.rl.model.policy import load_policy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see ONE_THREAD
    yield load_policy(tiny_path)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(policy) -> list[list[int]]:
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout

    _, _, fmt = policy
    train, _ = train_and_heldout(0, N_TRAIN, N_HELDOUT)
    ids = [fmt.render_ids(Countdown().prompt(p)) for p in train[:12]]
    ids.sort(key=len)
    assert len(ids[0]) < len(ids[-1])  # different lengths: left padding is exercised
    return [ids[0], ids[-1], ids[5]]


def recomputed(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits[t-1] / T)[token_t] of one unpadded forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    scored = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)] / temperature  # causal shift
    return torch.log_softmax(scored, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


async def until_generating(sampler, call: asyncio.Future | None = None, timeout_s: float = 60.0) -> None:
    """Wait until the sampler actor has a generate call in flight (its ``stats().generating``),
    so that what the test does next lands during a batch however fast or loaded the machine is.
    ``call``: the test's own call that generates; if it ends before a poll saw it in flight, the
    overlap the test needs is gone, and that is said at once (not after ``timeout_s`` of polls)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (await sampler.stats()).generating:
        if call is not None and call.done():
            outcome = call.exception() or "it returned"
            raise AssertionError(
                f"sampler {sampler.name}: the generate ended before a poll saw it in flight ({outcome})"
            )
        assert loop.time() < deadline, f"sampler {sampler.name}: no generate in flight within {timeout_s:g} s"
        await asyncio.sleep(0.005)


class Scripted(Environment):
    """Three model turns whatever they say: replies ``<result>k</result>`` after turns 1 and 2;
    the reward is how many turns ended at the stop string (``stopped`` metric), plus 0.5."""

    name = "scripted"
    max_turns = 3

    def __init__(self, stop: str):
        super().__init__()
        self.stop = [stop]

    def prompt(self, problem):
        return problem

    def step(self, episode, completion):
        episode.state["stopped"] = episode.state.get("stopped", 0) + completion.endswith(self.stop[0])
        if episode.model_turns < 3:
            return Reply(f"<result>{episode.model_turns}</result>")
        return Reply(done=True, reward=episode.state["stopped"] + 0.5, metrics={"stopped": episode.state["stopped"]})
