"""The sampler: HFBackend's exact log-probs, stops, seeds and pausing (in process), then the
SamplerActor in a real actor process: its rollout stream and a weight update over a gloo group."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import msgspec
import pytest
import torch

from asyncrl import RemoteError, Supervisor, endpoint
from asyncrl.comm.member import SyncMember, form_group
from asyncrl.comm.weights import WeightSender
from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.generation import SamplingParams, VersionSpan
from asyncrl.rl.rollout import validate_group
from asyncrl.rl.sampler.actor import SamplerActor
from asyncrl.rl.sampler.errors import SamplerClosedError, SamplerTimeoutError
from conftest import wait_until
from sampler_support import HOST, N_HELDOUT, N_TRAIN, ONE_THREAD, recomputed, until_generating, write_tiny

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

pytest_plugins = ["sampler_support"]  # its fixtures: tiny_path, policy, prompts


class WeightPusher(SyncMember):
    """Test-only trainer stand-in: holds weights read from a safetensors file and sends them.
    Needs no transformers, so it starts in a fraction of the sampler's time."""

    def __init__(self, weights_file: str):
        from safetensors.torch import load_file

        self.state = load_file(weights_file)
        self.sender: WeightSender | None = None

    @endpoint
    async def setup(self, timeout_s: float = 20.0) -> int:
        self.sender = await asyncio.to_thread(
            WeightSender.create, self.sync_comm, self.sync_group, self.state, timeout_s=timeout_s
        )
        return len(self.sender.layout.buckets)

    @endpoint
    async def send(self, version: int) -> float:
        return (await asyncio.to_thread(self.sender.send, version)).seconds


# --- fixtures (and sampler_support's: tiny_path, policy, prompts) ---------------------------------


@pytest.fixture
def backend(policy):
    from asyncrl.rl.sampler.hf import HFBackend

    model, tok, _ = policy
    b = HFBackend(model, tokenizer=tok, seed=0)
    yield b
    b.close()


# --- SamplingParams -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"max_new_tokens": 0},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"stop_token_ids": [-1]},
        {"seed": -3},
    ],
)
def test_sampling_params_are_validated(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sampling_params_cross_the_wire():
    p = SamplingParams(max_new_tokens=5, temperature=0.5, top_p=0.9, stop_token_ids=[1, 2], seed=7)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


# --- HFBackend in process -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_recomputation(backend, policy, prompts, temperature):
    model = policy[0]
    out = await backend.generate(prompts, 3, SamplingParams(max_new_tokens=20, temperature=temperature))
    assert [len(g) for g in out] == [3, 3, 3]
    for prompt, group in zip(prompts, out):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) == 20 and c.finish_reason == "length"
            ref = recomputed(model, prompt, c.token_ids, temperature)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0), (c.logprobs, ref.tolist())


async def test_top_p_logprobs_are_of_the_renormalised_nucleus(backend, policy, prompts):
    model, top_p, temperature = policy[0], 0.5, 0.8
    out = await backend.generate(
        prompts[:2], 2, SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p)
    )
    for prompt, group in zip(prompts, out):
        for c in group:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0]
            for t, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
                probs = torch.softmax(logits[len(prompt) - 1 + t] / temperature, -1)
                sorted_p, order = probs.sort(descending=True)
                keep = int((sorted_p.cumsum(0) < top_p).sum()) + 1  # smallest set with mass >= top_p
                nucleus = order[:keep].tolist()
                assert token in nucleus
                assert abs(lp - float(torch.log(probs[token] / sorted_p[:keep].sum()))) < 1e-4


async def test_stop_tokens_and_max_new_tokens(backend, prompts):
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    [[free]] = await backend.generate(prompts[:1], 1, greedy)
    assert len(free.token_ids) == 16 and free.finish_reason == "length"
    # The first token that has not appeared before it becomes a stop token: generation must end
    # right there, that token included with its log-prob, nothing after it.
    cut = max(i for i in range(16) if free.token_ids[i] not in free.token_ids[:i])
    stop = free.token_ids[cut]
    [[stopped]] = await backend.generate(prompts[:1], 1, msgspec.structs.replace(greedy, stop_token_ids=[stop]))
    assert stopped.token_ids == free.token_ids[: cut + 1] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(free.logprobs[: cut + 1], abs=1e-5)
    [[short]] = await backend.generate(prompts[:1], 1, msgspec.structs.replace(greedy, max_new_tokens=3))
    assert short.token_ids == free.token_ids[:3] and short.finish_reason == "length"


async def test_exact_lengths_cut_each_row_at_its_own_length(backend, prompts):
    """``exact_lengths`` (``--sampler.lengths``): the batch decodes to the longest, no stop token
    ends a row, and each row is its first ``L`` tokens, as decoded without the others."""
    free = SamplingParams(max_new_tokens=12, temperature=0.0)
    [[whole]] = await backend.generate(prompts[:1], 1, free)
    stops = msgspec.structs.replace(free, stop_token_ids=[whole.token_ids[0]], exact_lengths=[5, 12])
    [[a, b]] = await backend.generate(prompts[:1], 2, stops)
    assert (a.token_ids, b.token_ids) == (whole.token_ids[:5], whole.token_ids)
    assert a.finish_reason == b.finish_reason == "length" and a.logprobs == pytest.approx(whole.logprobs[:5], abs=1e-5)
    with pytest.raises(ValueError, match="exact_lengths must each be in"):
        msgspec.structs.replace(free, exact_lengths=[13])


async def test_tokens_decoded_moves_with_each_decoding_step(backend, prompts):
    """`tokens_decoded` (the sampler's ``decoded``, by which the driver waits out a long group
    rather than losing the sampler: driver/fleet/decoding.py) counts every row at every step, while
    the call runs: told after a row's k-th token, it has counted at least k steps of every row."""
    rows, steps = 4, 10
    before = backend.tokens_decoded()
    seen: list[tuple[int, int]] = []

    def progress(row: int, ids: list[int]) -> None:
        seen.append((len(ids), backend.tokens_decoded() - before))

    params = SamplingParams(max_new_tokens=steps, temperature=1.0, exact_lengths=[steps] * rows)
    await backend.generate(prompts[:2], 2, params, progress)
    assert {k for k, _ in seen} == set(range(1, steps + 1)), seen
    assert all(counted >= k * rows for k, counted in seen), seen
    assert backend.tokens_decoded() - before == rows * steps


async def test_decoding_passes_transformers_nothing_it_deprecates(backend, prompts):
    """The decoding loop's forward arguments (the KV cache, ``logits_to_keep``...) are current on
    the transformers installed: a deprecation of any of them fails here, by its warning, before it
    breaks us (5.24 deprecated ``past_key_values`` for ``cache``: issue 44, `kv_cache_name`)."""
    import logging
    import warnings

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    seen = Records()
    library = logging.getLogger("transformers")  # it logs there without propagating to the root
    library.addHandler(seen)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await backend.generate(prompts[:2], 2, SamplingParams(max_new_tokens=4))
    finally:
        library.removeHandler(seen)
    said = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    said += [line for line in seen.lines if "deprecat" in line.lower() or "will be removed" in line.lower()]
    assert not said, said


async def test_rows_stop_independently_in_a_batch(backend, prompts):
    """A row that stopped must not end, or change, the others."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    free = await backend.generate(prompts, 2, params)
    stop = free[1][0].token_ids[4]
    got = await backend.generate(prompts, 2, msgspec.structs.replace(params, stop_token_ids=[stop]))
    for g_free, g_got in zip(free, got):
        for a, b in zip(g_free, g_got):
            if stop in a.token_ids:
                end = a.token_ids.index(stop) + 1
                assert b.token_ids == a.token_ids[:end] and b.finish_reason == "stop"
            else:
                assert b.token_ids == a.token_ids and b.finish_reason == "length"


async def test_seeded_calls_are_reproducible(backend, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=42)
    a = await backend.generate(prompts, 4, params)
    b = await backend.generate(prompts, 4, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert len({tuple(c.token_ids) for c in a[0]}) > 1  # the n samples of one prompt differ
    other = await backend.generate(prompts, 4, msgspec.structs.replace(params, seed=43))
    assert [[c.token_ids for c in g] for g in a] != [[c.token_ids for c in g] for g in other]
    unseeded = msgspec.structs.replace(params, seed=None)  # the backend's own stream moves on
    assert (await backend.generate(prompts, 1, unseeded)) != (await backend.generate(prompts, 1, unseeded))


# --- HFBackend: stop strings ----------------------------------------------------------------------


@pytest.fixture
def text_prompts(policy) -> list[list[int]]:
    """Prompts rendered from plain text (independent of any task's prompt helpers)."""
    from asyncrl.rl.tasks.base import as_prompt

    fmt = policy[2]
    return [fmt.render_ids(as_prompt(t)) for t in ("3 7 25 50 -> 178", "1 2 -> 3", "10 20 30 40 5 -> 999")]


def _first_holding(tok, ids: list[int], stop: str) -> int:
    """The fewest leading tokens whose text holds ``stop``."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))


async def test_a_stop_string_ends_a_row_at_the_token_that_completes_it(backend, policy, text_prompts):
    tok = policy[1]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    [[free]] = await backend.generate(text_prompts[:1], 1, greedy)
    needle = free.text[8:10]
    assert needle.strip(), free.text
    [[got]] = await backend.generate(text_prompts[:1], 1, msgspec.structs.replace(greedy, stop=[needle]))
    end = _first_holding(tok, free.token_ids, needle)
    # Every token up to the completing one, with its log-prob; the text ends before the string
    # (vLLM's default: include_stop_str_in_output=False).
    assert got.token_ids == free.token_ids[:end] and got.finish_reason == "stop"
    assert got.logprobs == pytest.approx(free.logprobs[:end], abs=1e-5)
    assert got.text == free.text[: free.text.index(needle)]
    # Of several strings the one completed first ends it; one never written changes nothing.
    later = free.text[14:17]
    [[both]] = await backend.generate(text_prompts[:1], 1, msgspec.structs.replace(greedy, stop=[later, needle]))
    assert both == got
    [[none]] = await backend.generate(text_prompts[:1], 1, msgspec.structs.replace(greedy, stop=["\x01never"]))
    assert none == free


async def test_stop_strings_stop_rows_independently_and_a_stop_token_wins(backend, policy, text_prompts):
    tok = policy[1]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)
    free = await backend.generate(text_prompts, 3, params)
    needle = free[1][0].text[5:7]
    got = await backend.generate(text_prompts, 3, msgspec.structs.replace(params, stop=[needle]))
    for g_free, g_got in zip(free, got):
        for a, b in zip(g_free, g_got):
            if needle in a.text:
                end = _first_holding(tok, a.token_ids, needle)
                assert b.token_ids == a.token_ids[:end] and b.finish_reason == "stop"
                assert b.text == a.text[: a.text.index(needle)]
            else:
                assert b == a
    # A stop token before the string ends the row there, its text without the token as ever.
    first = free[1][0]
    token = first.token_ids[1]
    both = msgspec.structs.replace(params, stop=[needle], stop_token_ids=[token])
    c = (await backend.generate(text_prompts, 3, both))[1][0]  # the same seeds: the same prompt index
    cut = first.token_ids.index(token)
    assert c.token_ids == first.token_ids[: cut + 1] and c.finish_reason == "stop"
    assert c.text == tok.decode(first.token_ids[:cut], skip_special_tokens=True)


def test_stop_strings_see_characters_split_over_byte_tokens(policy):
    from asyncrl.rl.sampler.hf import StopStrings, text_before_stop

    tok = policy[1]
    ids = tok("ab\u00e9</calc>cd", add_special_tokens=False)["input_ids"]  # é is two byte tokens
    strings = StopStrings(tok, ["\u00e9<", "</calc>"], 2)
    hits = [strings.completed([t, t], [True, i != 1]) for i, t in enumerate(ids)]
    # "é<" is complete at "<" (index 4), not at either byte of é; row 1 was closed at step 1 only.
    assert hits[:4] == [[], [], [], []] and hits[4] == [0, 1]
    assert text_before_stop("ab\u00e9</calc>cd", ["</calc>", "\u00e9<"]) == "ab"
    assert text_before_stop("x</calc>", ["y"]) == "x</calc>"


async def test_bad_requests_are_refused(backend, prompts):
    with pytest.raises(ValueError):
        await backend.generate(prompts, 0, SamplingParams())
    with pytest.raises(ValueError):
        await backend.generate([[]], 1, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await backend.generate([[1, backend.vocab_size]], 1, SamplingParams())


async def test_close_releases_generates_held_by_a_pause(backend, prompts):
    await backend.pause(timeout_s=5)
    held = asyncio.ensure_future(backend.generate(prompts, 1, SamplingParams(max_new_tokens=2)))
    await asyncio.sleep(0.05)
    backend.close()
    with pytest.raises(SamplerClosedError):
        await asyncio.wait_for(held, 5)
    with pytest.raises(SamplerClosedError):
        await backend.generate(prompts, 1, SamplingParams(max_new_tokens=2))


async def test_pause_waits_for_the_generate_in_flight_and_holds_new_ones(backend, prompts):
    long = SamplingParams(max_new_tokens=200, temperature=1.0)  # ~0.5 s on 2 cores
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick_task = asyncio.ensure_future(ticker())
    first = asyncio.ensure_future(backend.generate(prompts * 4, 4, long))
    await asyncio.sleep(0.05)
    assert not first.done()
    await backend.pause(timeout_s=30)
    # pause returned only after the worker thread finished: the result is there for the taking
    assert backend._inflight == 0
    assert len(await asyncio.wait_for(first, 0.5)) == 12
    assert ticks >= 5  # the event loop kept running during generation (worker thread)

    held = asyncio.ensure_future(backend.generate(prompts, 1, SamplingParams(max_new_tokens=4)))
    await asyncio.sleep(0.3)
    assert not held.done() and backend._inflight == 0  # not started while paused
    await backend.resume()
    assert len(await asyncio.wait_for(held, 30)) == 3
    tick_task.cancel()


async def test_pause_counts_a_cancelled_callers_thread_as_in_flight(backend, prompts):
    """A caller that gives up leaves the worker thread running; weights must not change under it."""
    call = asyncio.ensure_future(backend.generate(prompts * 4, 4, SamplingParams(max_new_tokens=200)))
    await asyncio.sleep(0.05)
    call.cancel()
    await asyncio.sleep(0)
    assert backend._inflight == 1
    start = time.monotonic()
    await backend.pause(timeout_s=30)
    assert backend._inflight == 0 and time.monotonic() - start > 0.05
    await backend.resume()


async def test_in_flight_load_goes_in_between_decoding_steps(backend, policy, prompts):
    """The batch in flight is not waited for: it starts on the old weights and ends on the new."""
    greedy = SamplingParams(max_new_tokens=200, temperature=0.0, stop_token_ids=[])
    params = backend.weight_tensors()
    original = {k: v.clone() for k, v in params.items()}
    g = torch.Generator().manual_seed(3)
    changed = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in original.items()}

    def put(state):
        def load(tensors):
            seen.append(backend._inflight)
            for k, v in tensors.items():
                v.copy_(state[k])

        return load

    seen: list[int] = []
    try:
        old = await backend.generate(prompts, 1, greedy)
        put(changed)(params)
        new = await backend.generate(prompts, 1, greedy)
        put(original)(params)
        seen.clear()
        # The fifth forward pass (a decoding step) waits until the load below is waiting for it:
        # the load then goes in right after that step, however fast or loaded the machine is.
        reached, release = threading.Event(), threading.Event()
        forwards = [0]

        def hold_fifth_step(module, args):
            forwards[0] += 1
            if forwards[0] == 5:
                reached.set()
                assert release.wait(30), "the test never released the fifth decoding step"

        hook = backend.model.register_forward_pre_hook(hold_fifth_step)
        try:
            call = asyncio.ensure_future(backend.generate(prompts, 1, greedy))
            assert await asyncio.to_thread(reached.wait, 30), "the batch never reached its fifth decoding step"
            before = backend.weights_version
            load = asyncio.ensure_future(
                backend.load_weights(put(changed), version=before + 3, in_flight=True, timeout_s=10)
            )
            assert await asyncio.to_thread(wait_until, lambda: backend._loads == 1, 10.0)
            assert not call.done()
            release.set()
            await load
        finally:
            release.set()
            hook.remove()
        assert seen == [1]  # loaded while the batch was being decoded: one batch in flight
        mixed = await asyncio.wait_for(call, 30)
        for o, n, m in zip(old, new, mixed):
            o, n, m = o[0].token_ids, n[0].token_ids, m[0].token_ids
            assert m[0] == o[0] and m != o and m != n  # began on the old weights, went on with the new
        # Tokens 0-4 came of the five forward passes before the load, the rest of the new weights.
        assert all(c[0].version_spans == [VersionSpan(0, before), VersionSpan(5, before + 3)] for c in mixed)
        assert backend.weights_version == before + 3 and not any(c[0].version_spans for c in old + new)

        put(original)(params)
        seen.clear()
        call = asyncio.ensure_future(backend.generate(prompts, 1, greedy))
        await asyncio.sleep(0.1)
        await backend.load_weights(put(changed), version=before + 4, in_flight=False, timeout_s=30)
        assert seen == [0]  # pause mode: loaded once the batch had finished
        paused = await asyncio.wait_for(call, 5)
        assert [c[0].token_ids for c in paused] == [c[0].token_ids for c in old]
        assert not any(c[0].version_spans for c in paused) and backend.weights_version == before + 4
    finally:
        put(original)(params)  # the model is shared by the module's tests


async def test_in_flight_load_times_out_without_touching_the_weights(backend, prompts):
    backend._stepping = True  # a decoding step that never ends
    touched = []
    with pytest.raises(SamplerTimeoutError, match="decoding step did not end within 0.2 s"):
        await backend.load_weights(touched.append, version=1, in_flight=True, timeout_s=0.2)
    assert not touched and backend._loads == 0
    backend._stepping = False
    assert len(await backend.generate(prompts, 1, SamplingParams(max_new_tokens=2))) == 3  # not left blocked


# --- the actor ----------------------------------------------------------------------------------


def _modified_weights(model, path: str) -> str:
    """The sampler's parameters (named_parameters: tied embeddings once), changed, as a file."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    state = {
        name: (p.detach() + 0.5 * torch.randn(p.shape, generator=g)).contiguous()
        for name, p in model.named_parameters()
    }
    file = os.path.join(path, "modified.safetensors")
    save_file(state, file)
    return file


async def test_sampler_actor_streams_groups_and_takes_new_weights(tiny_path, policy, tmp_path):
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout

    _, _, fmt = policy
    train, _ = train_and_heldout(5, N_TRAIN, N_HELDOUT)
    weights_file = _modified_weights(policy[0], str(tmp_path))
    probe = [fmt.render_ids(Countdown().prompt(train[0]))]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    async with Supervisor(call_timeout_s=60) as sup:
        sampler, pusher = await asyncio.gather(
            # The HF backend, weights taken after the batch in flight (the actor's defaults once).
            sup.spawn(
                SamplerActor,
                tiny_path,
                SamplerConfig(
                    group_size=3,
                    prompts_per_batch=2,
                    max_new_tokens=24,
                    temperature=1.0,
                    weight_update="pause",
                    backend="hf",
                ),
                name="smp",
                kwargs=dict(data=DataConfig(n_train=N_TRAIN, n_heldout=N_HELDOUT, data_seed=5), seed=1),
                env=ONE_THREAD,
            ),
            sup.spawn(WeightPusher, weights_file, name="pusher", env=ONE_THREAD),
        )
        await form_group([pusher, sampler], HOST, timeout_s=30)
        assert (await asyncio.gather(pusher.setup(), sampler.setup_receiver(20)))[0] >= 1
        before = await sampler.generate(probe, 1, greedy)

        # A bounded stream: exactly max_groups valid groups of version 0.
        first = [g async for g in sampler.rollouts(3)]
        assert len(first) == 3
        for g in first:
            validate_group(g)
            assert g.version == 0 and g.sampler == "smp" and g.group_size == 3 and g.generate_s > 0
            assert g.prompt_ids == fmt.render_ids(
                Countdown().prompt(train[g.prompt_id])
            )  # prompt_id indexes the train split
            assert all(len(c) >= 1 for c in g.completion_ids) and g.finished_at <= time.time()

        # A generate in flight when the sync begins finishes under the old weights, then the
        # sync goes ahead (the call arrives first on the same connection, so it is in flight).
        inflight = asyncio.ensure_future(
            sampler.generate(probe * 8, 4, msgspec.structs.replace(greedy, max_new_tokens=400))
        )
        await asyncio.sleep(0.1)
        _, synced = await asyncio.gather(pusher.send(1), sampler.receive_weights(1))
        assert inflight.done() and synced.seconds > 0
        # The wait for the generate in flight is the pause; the rest, the receive and the resume.
        assert synced.pause_s > 0.02 and synced.receive.version == 1 and synced.resume_s >= 0
        assert synced.pause_s + synced.receive.seconds + synced.resume_s <= synced.seconds + 1e-6
        stats = await sampler.stats()
        assert stats.syncs_waited_for_generate == 1 and stats.pause_s > 0.02, stats
        assert all(c.token_ids[:16] == before[0][0].token_ids for g in inflight.result() for c in g)
        after = await sampler.generate(probe, 1, greedy)
        assert after[0][0].token_ids != before[0][0].token_ids  # greedy output changed with the weights

        # A continuous stream; the weights change again while it runs.
        stream = sampler.rollouts()
        versions = []
        synced = None
        async for g in stream:
            validate_group(g)
            versions.append(g.version)
            if len(versions) == 2:
                synced = asyncio.ensure_future(asyncio.gather(pusher.send(2), sampler.receive_weights(2)))
            if synced is not None and synced.done() and versions.count(2) >= 4:
                break
            assert len(versions) < 200, f"no group of the new version arrived: {versions}"
        await stream.aclose()
        await synced
        assert versions[0] == 1 and versions[-1] == 2
        assert versions == sorted(versions)  # nothing generated before the sync comes after one from after it

        # A failed sync (the two sides disagree on the version) may leave half-written weights:
        # no rollout starts until a sync succeeds.
        failed = await asyncio.gather(pusher.send(3), sampler.receive_weights(4), return_exceptions=True)
        assert all(isinstance(r, RemoteError) and r.remote_type == "WeightSyncError" for r in failed), failed
        waiting = asyncio.ensure_future(_collect(sampler.rollouts(1)))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await asyncio.gather(pusher.send(5), sampler.receive_weights(5))
        [late] = await asyncio.wait_for(waiting, 20)
        assert late.version == 5

        stats = await sampler.stats()
        assert stats.version == 5 and stats.syncs == 3 and stats.failed_syncs == 1 and stats.tokens > 0
        assert stats.groups >= 4 + len(versions) and stats.tokens_per_s > 0
        assert (await sampler.sync_created()) == {"gloo": 1}


async def _collect(stream) -> list:
    return [g async for g in stream]


async def test_sampler_actor_takes_weights_in_flight(tmp_path):
    """weight_update="in_flight": a sync does not wait for the batch being generated, which is
    tagged with the version it began under; a batch in flight during a failed sync is discarded."""
    from asyncrl.rl.model.policy import load_policy

    # The syncs below must land mid-batch: they start once a batch is in flight, and a batch of 32
    # sampled rows on a 256-wide model takes ~1 s on this 2-core machine (the 64-wide one: 0.3 s).
    # Random weights stop a row within 300 tokens ~2/3 of the time; all 32 stopping early: ~4e-6.
    wide = write_tiny(str(tmp_path / "wide"), hidden_size=256)
    weights_file = _modified_weights(load_policy(wide)[0], str(tmp_path))
    long = SamplerConfig(
        group_size=4, prompts_per_batch=8, max_new_tokens=300, temperature=1.0, weight_update="in_flight", backend="hf"
    )
    async with Supervisor(call_timeout_s=60) as sup:
        sampler, pusher = await asyncio.gather(
            sup.spawn(
                SamplerActor,
                wide,
                long,
                name="smp",
                kwargs=dict(data=DataConfig(n_train=N_TRAIN, n_heldout=N_HELDOUT), seed=1),
                env=ONE_THREAD,
            ),
            sup.spawn(WeightPusher, weights_file, name="pusher", env=ONE_THREAD),
        )
        await form_group([pusher, sampler], HOST, timeout_s=30)
        await asyncio.gather(pusher.setup(), sampler.setup_receiver(20))

        batch = asyncio.ensure_future(_collect(sampler.rollouts(8)))
        await until_generating(sampler)
        await asyncio.gather(pusher.send(1), sampler.receive_weights(1))
        # The sync went in while the batch was being decoded: it waited for no generate (the stats
        # below). Not `not batch.done()`: on a loaded machine the batch can end before this line.
        groups = await asyncio.wait_for(batch, 30)
        assert [g.version for g in groups] == [0] * 8  # the version the batch began under
        stats = await sampler.stats()
        assert stats.syncs == 1 and stats.syncs_waited_for_generate == 0 and stats.pause_s < 0.2, stats

        batch = asyncio.ensure_future(_collect(sampler.rollouts(8)))
        await until_generating(sampler)
        failed = await asyncio.gather(pusher.send(2), sampler.receive_weights(3), return_exceptions=True)
        assert all(isinstance(r, RemoteError) for r in failed), failed
        await asyncio.sleep(0.3)
        assert not batch.done()  # its batch was discarded; the next waits for a good sync
        await asyncio.gather(pusher.send(4), sampler.receive_weights(4))
        late = await asyncio.wait_for(batch, 30)
        assert [g.version for g in late] == [4] * 8
        stats = await sampler.stats()
        assert stats.discarded_batches == 1 and stats.failed_syncs == 1, stats
