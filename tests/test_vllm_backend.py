"""The vLLM backend in this process, for real: a vLLM engine (the CPU build on CPU, the CUDA build
on the first GPU) on a tiny random Qwen2 (head_dim 32). Log-probs against a recomputation by the
HF model on the same weights in the same dtype (fp32; on a GPU also bf16), stops, seeds, abort,
pause/resume, and weights sent over gloo into vLLM's own worker process (pause and in-flight)
through the backend's weight sink.

Where vLLM is not installed these tests skip, unless ``ASYNCRL_REQUIRE_VLLM=1`` (see vllm_support).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import pytest_asyncio
import torch

from asyncrl import Supervisor
from asyncrl.comm.address import SyncAddress
from asyncrl.comm.rendezvous import join_all
from asyncrl.rl.generation import SamplingParams, VersionSpan
from asyncrl.rl.tasks.base import as_prompt
from asyncrl.rl.tasks.episodes import EpisodeRunner
from asyncrl.rl.tasks.scoring import UserCalls
from conftest import wait_until
from sampler_support import HOST, Scripted, recomputed
from vllm_support import (
    SYNC_BACKEND,
    StatePusher,
    engine_options,
    reference_logprobs,
    repeat_abs,
    running_s,
    state_files,
)

pytest_plugins = ["sampler_support", "vllm_support"]  # fixtures: tiny_path, policy, prompts; vllm_required, engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("actor_zygote")]  # tests/conftest.py: forked actors


# --- the backend in this process ------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.0, 1.0)])
async def test_logprobs_match_the_hf_model(engine, policy, prompts, temperature, top_p):
    model = policy[0]
    n = 2 if temperature == 0 else 3  # greedy n > 1: one vLLM request, its sample repeated
    out = await engine.generate(prompts, n, SamplingParams(max_new_tokens=20, temperature=temperature, top_p=top_p))
    assert [len(g) for g in out] == [n] * len(prompts)
    for prompt, group in zip(prompts, out):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) == 20 and c.finish_reason == "length"
            ref = reference_logprobs(model, prompt, c.token_ids, temperature or 1.0)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=2e-3, rtol=0), (c.logprobs, ref.tolist())
            if temperature == 0:  # greedy: each token is the HF model's argmax too
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
                assert logits.argmax(-1).tolist() == c.token_ids


@pytest.mark.asyncio(loop_scope="module")
async def test_top_p_logprobs_are_renormalised_over_the_nucleus(engine, policy, prompts):
    out = await engine.generate(prompts[:1], 2, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.5))
    model = policy[0]
    for c in out[0]:
        full = reference_logprobs(model, prompts[0], c.token_ids, 1.0)
        assert all(lp >= f - 1e-3 for lp, f in zip(c.logprobs, full))  # the nucleus mass is <= 1


@pytest.mark.asyncio(loop_scope="module")
async def test_top_logprobs_are_the_likeliest_tokens_of_the_sampling_distribution(engine, policy, prompts):
    """``top_logprobs`` k: per token, the k likeliest of the distribution it was drawn from (the
    HF model's at the same temperature), likeliest first; the sampled one's own log-prob among them
    whenever it ranks in k."""
    model = policy[0]
    [[c]] = await engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=6, temperature=0.7, top_logprobs=3))
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + c.token_ids])).logits[0, len(prompts[0]) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, -1).topk(3)
    assert len(c.top_logprobs) == len(c.token_ids)
    for top, token, lp, ids, values in zip(
        c.top_logprobs, c.token_ids, c.logprobs, expected.indices.tolist(), expected.values.tolist()
    ):
        assert [t for t, _ in top] == ids
        assert [v for _, v in top] == pytest.approx(values, abs=2e-3)
        if token in ids:
            assert dict(top)[token] == lp


@pytest.mark.asyncio(loop_scope="module")
async def test_progress_reports_each_rows_tokens_as_the_engine_makes_them(engine, prompts):
    """The stream's source on vLLM: each row's tokens so far, growing, as the engine outputs them
    (more than once per row), its last report the completion's tokens; a greedy request's one
    sample is reported for each of its n rows."""
    for temperature in (1.0, 0.0):
        reports: dict[int, list[list[int]]] = {}
        groups = await engine.generate(
            prompts[:2],
            2,
            SamplingParams(max_new_tokens=8, temperature=temperature, seed=1),
            lambda row, ids, reports=reports: reports.setdefault(row, []).append(ids),
        )
        rows = [c.token_ids for g in groups for c in g]
        assert sorted(reports) == [0, 1, 2, 3]
        for row, ids in enumerate(rows):
            assert len(reports[row]) > 1 and reports[row][-1] == ids
            assert all(ids[: len(r)] == r and len(r) > len(p) for p, r in zip([[]] + reports[row], reports[row]))


@pytest.mark.asyncio(loop_scope="module")
async def test_stops_max_tokens_and_stop_strings(engine, prompts, policy, vllm_required):
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    [[free]] = await engine.generate(prompts[:1], 1, greedy)
    assert len(free.token_ids) == 16 and free.finish_reason == "length"
    cut = max(i for i in range(16) if free.token_ids[i] not in free.token_ids[:i])
    stop = free.token_ids[cut]
    [[stopped]] = await engine.generate(prompts[:1], 1, msgspec.structs.replace(greedy, stop_token_ids=[stop]))
    assert stopped.token_ids == free.token_ids[: cut + 1] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(free.logprobs[: cut + 1], abs=repeat_abs(vllm_required))
    [[short]] = await engine.generate(prompts[:1], 1, msgspec.structs.replace(greedy, max_new_tokens=3))
    assert short.token_ids == free.token_ids[:3] and short.finish_reason == "length"
    # A stop string: the text ends before it.
    tok = policy[1]
    text = free.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    if needle.strip():
        [[by_string]] = await engine.generate(prompts[:1], 1, msgspec.structs.replace(greedy, stop=[needle]))
        assert by_string.finish_reason == "stop" and needle not in by_string.text
        assert text.startswith(by_string.text)
        assert by_string.token_ids == free.token_ids[: len(by_string.token_ids)]
    assert tok.decode(free.token_ids, skip_special_tokens=True) == free.text


@pytest.mark.asyncio(loop_scope="module")
async def test_seeded_calls_are_reproducible(engine, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=42)
    a = await engine.generate(prompts, 4, params)
    b = await engine.generate(prompts, 4, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert len({tuple(c.token_ids) for c in a[0]}) > 1  # the n samples of one prompt differ
    other = await engine.generate(prompts, 4, msgspec.structs.replace(params, seed=43))
    assert [[c.token_ids for c in g] for g in a] != [[c.token_ids for c in g] for g in other]


# --- multi-turn episodes through the engine (here to share its start, 27 s of the 2-core machine) ---


PROBLEMS = ["3 7 25 50 -> 178", "1 2 -> 3", "10 20 30 40 5 -> 999"]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_three_turns_through_vllm(engine, policy, temperature):
    model, tok, fmt = policy
    prompts = [fmt.render_ids(as_prompt(p)) for p in PROBLEMS]
    [[free]] = await engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=16, temperature=0.0))
    needle = free.text[6:8]
    assert needle.strip(), free.text
    env = Scripted(needle)
    calls = UserCalls("scripted", 10.0, 0.0)
    runner = EpisodeRunner(env, fmt, calls, max_context=engine_options(torch.device("cpu"))["max_model_len"])
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=3, stop_token_ids=list(fmt.stop_token_ids))
    n = 1 if temperature == 0 else 3
    groups = await runner.run(PROBLEMS, n, params, engine.generate)
    stopped = 0
    for prompt, group in zip(prompts, groups):
        assert len(group) == n
        for s in group:
            assert s.error == "" and s.metrics["turns"] == 3.0 and s.metrics["episodes_truncated"] == 0.0
            assert s.reward == s.metrics["stopped"] + 0.5
            stopped += s.metrics["stopped"]
            # prompt | turn 1 | <result>1</result> | turn 2 | <result>2</result> | turn 3
            segments = [s.action_mask[0]] + [m for a, m in zip(s.action_mask, s.action_mask[1:]) if m != a]
            assert segments == [1, 0, 1, 0, 1]
            replies = [t for t, m in zip(s.token_ids, s.action_mask) if not m]
            assert tok.decode(replies) == "<result>1</result><result>2</result>"
            mask = torch.tensor(s.action_mask, dtype=torch.bool)
            logprobs = torch.tensor(s.logprobs)
            ref = recomputed(model, prompt, s.token_ids, temperature or 1.0)
            assert torch.allclose(logprobs[mask], ref[mask], atol=2e-3, rtol=0), (logprobs[mask], ref[mask])
            assert (logprobs[~mask] == 0).all()
    if temperature == 0:  # the first problem's first turn is the run the needle came from
        assert stopped > 0
    assert calls.take_counts()["calls"] == len(PROBLEMS) * n * 3
    again = await runner.run(PROBLEMS, n, params, engine.generate)
    assert again == groups


@pytest.mark.asyncio(loop_scope="module")
async def test_the_openai_endpoint_records_what_the_engine_generated(engine, policy, vllm_required):
    """Agents over vLLM (docs/agents.md): two concurrent sessions through the real openai client,
    each request handed to the engine at once (it batches them itself), two choices each (``n``);
    what each session recorded is the template's prompt and the engine's own tokens and log-probs
    for that seeded request, a call per choice, and the version the generation began under."""
    from asyncrl.rl.agents.server import OpenAIServer

    _, tok, fmt = policy
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=fmt.stop_token_ids)

    async def generate(prompts, n, params, progress=None):
        return 7, await engine.generate(prompts, n, params, progress)

    server = OpenAIServer(generate, tok, sampling, max_context=512, batch=False)
    await server.start()
    questions = ["3 7 25 50 -> 178", "1 2 3 4 -> 24"]
    sessions = [server.open_session() for _ in questions]

    async def ask(session, question):
        async with server.client(session.key) as client:
            return await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": question}],
                seed=5,
                logprobs=True,
                n=2,
                top_logprobs=2,
            )

    try:
        answers = await asyncio.gather(*(ask(s, q) for s, q in zip(sessions, questions)))
    finally:
        await server.close()
    for session, question, answer in zip(sessions, questions, answers):
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        assert len(session.calls) == len(answer.choices) == 2
        [directs] = await engine.generate(
            [session.calls[0].prompt_ids], 2, msgspec.structs.replace(sampling, seed=5, top_logprobs=2)
        )
        for call, choice, direct in zip(session.calls, answer.choices, directs):
            assert call.prompt_ids == tok(text, add_special_tokens=False)["input_ids"] and call.version == 7
            assert call.token_ids == direct.token_ids
            assert call.logprobs == pytest.approx(direct.logprobs, abs=repeat_abs(vllm_required))
            assert [t.logprob for t in choice.logprobs.content] == call.logprobs
            assert choice.message.content == direct.text
            assert [[t.token for t in e.top_logprobs] for e in choice.logprobs.content] == [
                [tok.decode([i]) for i, _ in top] for top in direct.top_logprobs
            ]


@pytest.mark.asyncio(loop_scope="module")
async def test_exact_lengths_run_each_row_as_long_as_told_and_the_engine_counts_its_cache(engine, prompts):
    """``exact_lengths`` (``--sampler.lengths``): a request per row, each stopped by its length
    alone; the engine's statistics say how large its KV cache is and that nothing was preempted."""
    lengths = [3, 17, 1, 40, 9, 25]
    params = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=[0, 1], exact_lengths=lengths)
    groups = await engine.generate(prompts[:3], 2, params)
    got = [c for g in groups for c in g]
    assert [len(c.token_ids) for c in got] == lengths and {c.finish_reason for c in got} == {"length"}
    assert all(len(c.logprobs) == len(c.token_ids) for c in got)
    stats = engine.engine_stats()
    assert stats["kv_cache_tokens"] > 0 and stats["preemptions"] == 0 and 0 < stats["kv_cache_peak"] <= 1
    with pytest.raises(ValueError, match="exact_lengths"):
        await engine.generate(prompts[:3], 1, params)  # 6 lengths for 3 rows


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cramped(tiny_path, policy, vllm_required):
    """A `VLLMBackend` whose KV cache holds 512 tokens (16 blocks of 32), its statistics counted."""
    from asyncrl.rl.sampler.vllm.backend import VLLMBackend

    options = engine_options(vllm_required) | {"max_model_len": 128, "num_gpu_blocks_override": 16, "block_size": 32}
    b = VLLMBackend(tiny_path, tokenizer=policy[1], device=vllm_required, engine=options, engine_stats=True)
    yield b
    b.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_kv_cache_too_small_for_the_sequences_in_flight_is_seen_as_preemptions_once(cramped, prompts):
    """16 sequences of 4 prompt and 100 new tokens at once in a cache of 512 tokens: the engine's
    scheduler takes some off to free cache, and `take_engine_window` gives each step's record what
    happened since the last one (each preemption once, the peak of that window)."""
    assert cramped.kv_cache_tokens == 512 and cramped.take_engine_window() == (0, 0.0)  # nothing ran yet
    params = SamplingParams(max_new_tokens=100, temperature=1.0, exact_lengths=[100] * 16)
    groups = await cramped.generate([p[:4] for p in prompts[:2]], 8, params)
    assert [len(c.token_ids) for g in groups for c in g] == [100] * 16  # preempted, computed again, whole
    preempted, peak = cramped.take_engine_window()
    assert preempted > 0 and peak > 0.9, (preempted, peak)  # full, less a block vLLM may keep aside
    assert cramped.engine_stats()["preemptions"] == preempted
    assert cramped.take_engine_window() == (0, 0.0)  # nothing ran since


@pytest.mark.asyncio(loop_scope="module")
async def test_bad_requests_are_refused(engine, prompts):
    with pytest.raises(ValueError):
        await engine.generate(prompts, 0, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate([[1, engine.vocab_size]], 1, SamplingParams())


@pytest.mark.asyncio(loop_scope="module")
async def test_a_cancelled_generate_aborts_its_requests(engine, prompts, vllm_required):
    from asyncrl.rl.sampler.vllm.compat import unfinished_requests

    long = SamplingParams(max_new_tokens=400, temperature=1.0)
    call = asyncio.ensure_future(engine.generate(prompts, 4, long))
    await asyncio.sleep(running_s(vllm_required, 0.5))
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert engine._inflight == 0
    assert wait_until(lambda: unfinished_requests(engine.engine) == 0, 5.0)
    start = time.monotonic()
    await engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=4))
    assert time.monotonic() - start < 5.0  # not queued behind the aborted requests


@pytest.mark.asyncio(loop_scope="module")
async def test_pause_waits_for_requests_in_flight_and_holds_new_ones(engine, prompts, vllm_required):
    long = SamplingParams(max_new_tokens=200, temperature=1.0)
    first = asyncio.ensure_future(engine.generate(prompts, 4, long))
    await asyncio.sleep(running_s(vllm_required, 0.2))
    assert not first.done()
    await engine.pause(timeout_s=60)
    assert first.done() and len(first.result()) == 3  # pause returned only once they had finished
    held = asyncio.ensure_future(engine.generate(prompts, 1, SamplingParams(max_new_tokens=4)))
    await asyncio.sleep(0.3)
    assert not held.done() and engine._inflight == 0  # not started while paused
    await engine.resume()
    assert len(await asyncio.wait_for(held, 30)) == 3


@pytest.mark.asyncio(loop_scope="module")
async def test_weights_go_into_the_engine_between_its_steps(engine, policy, prompts, tmp_path, vllm_required):
    """The engine's worker joins a gloo group with a sender and takes weights: after the running
    requests (pause mode), or between two steps of them (in-flight mode: they go on with the new
    weights). Runs last among the tests sharing ``engine``, and restores its weights."""
    files = state_files(policy[0], str(tmp_path))
    greedy = SamplingParams(max_new_tokens=400, temperature=0.0, stop_token_ids=[])
    sink = engine.weight_sink(None)  # the engine's process receives: no actor's communicator needed
    assert sink.weight_dtype == "float32"  # the CPU engine's dtype: what the trainer sends in
    async with Supervisor(call_timeout_s=60) as sup:
        pusher = await sup.spawn(StatePusher, files, name="pusher", env={"OMP_NUM_THREADS": "1"})
        port = await pusher.sync_listen(HOST)
        address = SyncAddress(host=HOST, port=port, world_size=2, backend=SYNC_BACKEND, timeout_s=30.0)
        backends = await join_all([pusher.sync_join(address, 0), sink.join(address, 1)], 45.0)
        assert backends == ["gloo", "gloo"]
        await asyncio.gather(pusher.setup(), sink.setup(30.0))
        try:
            old = await engine.generate(prompts, 1, greedy)
            await asyncio.gather(pusher.send(1, "changed"), sink.receive(1, in_flight=False, timeout_s=30.0))
            # How long these requests run on this machine, now: timed on the second call, since a
            # fresh engine's first (this test alone) runs several times slower, which would put the
            # in-flight sync below after the requests it must land in.
            start = time.monotonic()
            new = await engine.generate(prompts, 1, greedy)
            whole_s = time.monotonic() - start
            assert [g[0].token_ids for g in new] != [g[0].token_ids for g in old]
            await asyncio.gather(pusher.send(2, "original"), sink.receive(2, in_flight=False, timeout_s=30.0))
            assert [g[0].token_ids for g in await engine.generate(prompts, 1, greedy)] == [g[0].token_ids for g in old]

            # The sync starts a fifth of the way into the requests (as measured above, so on a fast
            # machine as on a slow one): their first tokens are out, most are still to come.
            call = asyncio.ensure_future(engine.generate(prompts, 1, greedy))
            await asyncio.sleep(whole_s / 5)
            _, synced = await asyncio.gather(pusher.send(3, "changed"), sink.receive(3, in_flight=True, timeout_s=30.0))
            # went in between two steps: its wait for the engine to take it (the step under way, the
            # call's round trip) was short beside the requests it would otherwise have waited for
            assert synced.pause_s == synced.call_s < whole_s / 2, (synced, whole_s)
            mixed = await asyncio.wait_for(call, 60)
            for o, n, m in zip(old, new, mixed):
                [first, switch] = m[0].version_spans  # where the engine stood when the weights went in
                assert first == VersionSpan(0, 2) and switch.version == 3 and 0 < switch.start < len(m[0].token_ids)
                o, n, m = o[0].token_ids, n[0].token_ids, m[0].token_ids
                assert m[0] == o[0] and m != o and m != n  # began on the old weights, went on with the new
                assert m[: switch.start] == o[: switch.start]  # every token before the switch is the old weights'
            assert engine.weights_version == 3
            assert await sink.created() == {"gloo": 1}
        finally:
            await asyncio.gather(pusher.send(4, "original"), sink.receive(4, in_flight=False, timeout_s=30.0))
            await sink.leave()


@pytest.mark.asyncio(loop_scope="module")
async def test_bf16_logprobs_match_a_bf16_reference(tiny_path, policy, prompts, vllm_required):
    """The GPU's own path (bf16 weights, FlashAttention, CUDA graphs) against the HF model in bf16:
    like with like, to bf16's precision. On the tiny model, bf16 moves a log-prob by at most 4e-3
    from fp32's (measured), so two bf16 computations by different kernels stay within 2e-2; a
    temperature wrongly applied moves them by about 6e-2 on average. Greedy tokens: the reference's
    argmax, up to that precision (a near-tie may fall either way in bf16)."""
    import copy

    from asyncrl.rl.sampler.vllm.backend import VLLMBackend

    if vllm_required.type != "cuda":
        pytest.skip("bf16 is the GPU's path; the CPU build runs the tests in fp32")
    tol = 2e-2
    b16 = VLLMBackend(
        tiny_path,
        tokenizer=policy[1],
        seed=0,
        device=vllm_required,
        engine=engine_options(vllm_required) | {"dtype": "bfloat16"},
    )
    try:
        assert b16.dtype == torch.bfloat16
        ref_model = copy.deepcopy(policy[0]).to(torch.bfloat16)
        for temperature in (1.0, 0.7, 0.0):
            out = await b16.generate(prompts, 2, SamplingParams(max_new_tokens=20, temperature=temperature))
            for prompt, group in zip(prompts, out):
                for c in group:
                    assert len(c.token_ids) == len(c.logprobs) == 20
                    ref = reference_logprobs(ref_model, prompt, c.token_ids, temperature or 1.0)
                    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=tol, rtol=0), (c.logprobs, ref.tolist())
                    if temperature == 0:
                        with torch.no_grad():
                            logits = ref_model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
                        best = torch.log_softmax(logits.float(), -1)
                        chosen = best.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
                        assert (best.max(-1).values - chosen).max() <= tol
    finally:
        b16.close()
