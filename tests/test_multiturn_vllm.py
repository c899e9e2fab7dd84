"""What the prefix cache buys multi-turn episodes through vLLM's CPU build: a measurement, opt-in
(it starts two engines on a larger model):
``ASYNCRL_MEASURE_PREFIX_CACHE=1 python -m pytest -s tests/test_multiturn_vllm.py -k prefix``.
The episodes themselves through vLLM (``test_three_turns_through_vllm``) are in
tests/test_vllm_backend.py, on the engine its tests share.

Where vLLM is not installed these tests skip, unless ``ASYNCRL_REQUIRE_VLLM=1`` (see vllm_support).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from asyncrl.rl.generation import SamplingParams
from asyncrl.rl.tasks.episodes import EpisodeRunner
from asyncrl.rl.tasks.scoring import UserCalls
from sampler_support import Scripted

pytest_plugins = ["vllm_support"]  # fixture: vllm_required

pytestmark = pytest.mark.timeout(600)

# --- measurement: what the prefix cache buys ---------------------------------------------------------


def _checkpoint(path: str, hidden: int, layers: int, positions: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        intermediate_size=4 * hidden,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump({"prompt_style": "compact", "max_new_tokens_hint": 32}, f)
    return path


@pytest.fixture(scope="module")
def resource_tracker():
    """multiprocessing's resource tracker, which vLLM starts and which outlives its engines, started
    before the test (a module-scoped fixture runs before the check for processes left behind)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.mark.skipif(
    os.environ.get("ASYNCRL_MEASURE_PREFIX_CACHE") != "1",
    reason="a measurement: ASYNCRL_MEASURE_PREFIX_CACHE=1 runs it",
)
async def test_what_the_prefix_cache_buys_later_turns(vllm_required, resource_tracker, tmp_path):
    """Seconds of the turn 2 and 3 generate calls, prefix cache on vs off: 16 episodes (8
    prompts of ~700 tokens, 2 each), 32 new tokens a turn, replies of ~20 tokens."""
    from asyncrl.rl.model.policy import load_prompt_format
    from asyncrl.rl.sampler.vllm.backend import VLLMBackend

    path = _checkpoint(str(tmp_path / "model"), hidden=256, layers=4, positions=2048)
    tok, fmt = load_prompt_format(path)
    problems = [" ".join(str((i * 37 + k * 11) % 1000) for k in range(180)) + f" -> {i}" for i in range(8)]
    # Unseeded: vLLM 0.32's CPU build kills its engine on a seeded request whose prefill is
    # chunked ("CPU Generator does not use offset"), and these prompts are. No stop token: every
    # turn is 32 tokens, on or off.
    params = SamplingParams(max_new_tokens=32, temperature=1.0, stop_token_ids=[])
    results = {}
    for caching in (True, False):
        backend = VLLMBackend(path, tokenizer=tok, seed=0, prefix_caching=caching, engine={"max_model_len": 2048})
        try:
            times: list[list[float]] = []
            for _ in range(3):
                per_turn: list[float] = []

                async def generate(prompts, n, p, backend=backend, per_turn=per_turn):
                    start = time.perf_counter()
                    out = await backend.generate(prompts, n, p)
                    per_turn.append(time.perf_counter() - start)
                    return out

                env = Scripted("\x01never")
                await EpisodeRunner(env, fmt, UserCalls("scripted", 10.0, 1.0)).run(problems, 2, params, generate)
                times.append(per_turn)
        finally:
            backend.close()
        results[caching] = times
        print(
            f"\nprefix caching {'on ' if caching else 'off'}: seconds per turn (1, 2, 3), 3 runs: "
            + "; ".join(" ".join(f"{t:.2f}" for t in run) for run in times),
            flush=True,
        )
    later = {c: min(run[1] + run[2] for run in times) for c, times in results.items()}
    print(
        f"turns 2+3, best of 3: on {later[True]:.2f} s, off {later[False]:.2f} s ({later[False] / later[True]:.2f}x)",
        flush=True,
    )
