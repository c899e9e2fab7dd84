"""Agents over the OpenAI API (asyncrl/rl/agents/), with the real ``openai`` client against the
endpoint on the HF backend (in process): the exact ids and log-probs recorded, one sample per
conversation that extends itself and separate ones after a history edit, concurrent sessions,
tool calls both ways, a hung and a raising agent, and requests without the token refused."""

from __future__ import annotations

import asyncio
import itertools
import json
import os

import msgspec
import openai
import pytest
import torch

from agent_support import CHAT_TEMPLATE, write_letters_tiny
from asyncrl.rl.agents.chat import parse_tool_calls, render_chat
from asyncrl.rl.agents.runner import AgentRunner
from asyncrl.rl.agents.server import OpenAIServer
from asyncrl.rl.agents.session import SessionCall, assemble
from asyncrl.rl.agents.wire import chat_answer
from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.sampler.hf import HFBackend
from asyncrl.rl.tasks.agent import FunctionAgent
from asyncrl.rl.tasks.loading import TaskLoadError, task_class
from asyncrl.rl.tasks.scoring import UserCalls
from sampler_support import recomputed

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its sampler forked from a zygote

MAX_NEW = 12


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    from asyncrl.rl.model.policy import load_policy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_policy(write_letters_tiny(str(tmp_path_factory.mktemp("letters"))))
    torch.set_num_threads(threads)


class Endpoint:
    """An `OpenAIServer` on an `HFBackend` of the letters model, counting the backend's calls."""

    def __init__(self, policy, **kwargs):
        model, self.tokenizer, self.fmt = policy
        self.backend = HFBackend(model, tokenizer=self.tokenizer)
        self.version, self.batches = 3, []
        self.sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=self.fmt.stop_token_ids)
        self.server = OpenAIServer(self.generate, self.tokenizer, self.sampling, max_context=512, **kwargs)

    async def generate(self, prompts, n, params, progress=None):
        self.batches.append(len(prompts))
        return self.version, await self.backend.generate(prompts, n, params, progress)

    def client(self, session: str = "", key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.server.base_url(session), api_key=key or self.server.token, max_retries=0, timeout=60
        )


def recomputed_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits each of ``tokens`` was drawn from, by one unpadded forward over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


@pytest.fixture
async def endpoint(letters):
    e = Endpoint(letters)
    await e.server.start()
    yield e
    await e.server.close()
    e.backend.close()


def template_ids(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_recorded_ids_and_logprobs_are_what_the_backend_generated(endpoint):
    session = endpoint.server.open_session()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a fruit"}]
    async with endpoint.client(session.key) as client:
        answer = await client.chat.completions.create(
            model="policy", messages=messages, seed=11, logprobs=True, temperature=0.1
        )  # a session samples at the run's temperature
    [call] = session.calls
    assert call.prompt_ids == template_ids(endpoint.tokenizer, messages)
    assert call.version == 3
    # The same prompt and seed, straight to the backend: the same tokens and the very same log-probs.
    params = msgspec.structs.replace(endpoint.sampling, seed=11)
    [[direct]] = await endpoint.backend.generate([call.prompt_ids], 1, params)
    assert call.token_ids == direct.token_ids and call.logprobs == direct.logprobs
    assert len(call.token_ids) == MAX_NEW and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content == direct.text
    assert [t.logprob for t in answer.choices[0].logprobs.content] == direct.logprobs
    assert answer.usage.prompt_tokens == len(call.prompt_ids)
    torch.testing.assert_close(
        torch.tensor(call.logprobs),
        recomputed(endpoint.backend.model, call.prompt_ids, call.token_ids, 1.0),
        atol=1e-4,
        rtol=0,
    )


async def test_completions_models_and_streaming(endpoint):
    async with endpoint.client() as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        text = await client.completions.create(model="policy", prompt="abc", max_tokens=5, logprobs=0, seed=2)
        assert len(text.choices[0].logprobs.token_logprobs) == 5 and text.usage.prompt_tokens == 3
        stream = await client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).isalpha()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4
    assert endpoint.server.sessions == {}  # the root records nothing


async def test_n_choices_are_samples_of_their_own_and_top_logprobs_are_the_sampling_distribution(endpoint):
    """``n`` = 3: three choices, each recorded as a call (the backend's own seeded rows), each a
    sample of its own; the conversation goes on from the second choice and extends that one only.
    ``top_logprobs``: per token, the k likeliest tokens of the distribution it was drawn from,
    likeliest first, the sampled one among them with its own log-prob whenever it ranks in k."""
    session = endpoint.server.open_session()
    messages = [{"role": "user", "content": "start"}]
    async with endpoint.client(session.key) as client:
        answer = await client.chat.completions.create(
            model="policy", messages=messages, n=3, seed=5, max_tokens=4, logprobs=True, top_logprobs=3
        )
        assert [c.index for c in answer.choices] == [0, 1, 2] and answer.usage.completion_tokens == 12
        messages += [
            {"role": "assistant", "content": answer.choices[1].message.content},
            {"role": "user", "content": "more"},
        ]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
            await client.chat.completions.create(model="policy", messages=messages, top_logprobs=2)
    first = session.calls[:3]
    [[*direct]] = await endpoint.backend.generate(
        [first[0].prompt_ids], 3, msgspec.structs.replace(endpoint.sampling, seed=5, max_new_tokens=4)
    )
    assert [(c.token_ids, c.logprobs) for c in first] == [(d.token_ids, d.logprobs) for d in direct]
    samples = assemble(session.calls)
    assert [s.calls for s in samples] == [1, 2, 1]  # choice 1 and the turn after it; choices 0 and 2 alone
    assert samples[1].token_ids[:4] == first[1].token_ids
    for choice, call in zip(answer.choices, first):
        logits = torch.log_softmax(recomputed_logits(endpoint.backend.model, call.prompt_ids, call.token_ids), -1)
        for entry, token, row in zip(choice.logprobs.content, call.token_ids, logits):
            top = row.topk(3)
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert [t.token for t in entry.top_logprobs] == [endpoint.tokenizer.decode([i]) for i in top.indices]
            if token in top.indices.tolist():
                assert entry.logprob in [t.logprob for t in entry.top_logprobs]


async def test_the_hf_backend_reports_each_rows_tokens_after_every_step(letters):
    """The stream's source on HF: after each decoding step, every open row's tokens so far, on the
    caller's loop, before the call returns; a row that stopped reports no more."""
    model, tok, fmt = letters
    backend = HFBackend(model, tokenizer=tok)
    reports: dict[int, list[list[int]]] = {}
    try:
        groups = await backend.generate(
            [tok("ab")["input_ids"], tok("c")["input_ids"]],
            2,
            SamplingParams(max_new_tokens=6, seed=3, stop=["q"]),
            lambda row, ids: reports.setdefault(row, []).append(ids),
        )
    finally:
        backend.close()
    rows = [c.token_ids for g in groups for c in g]
    assert sorted(reports) == [0, 1, 2, 3]
    for row, ids in enumerate(rows):
        assert reports[row] == [ids[:k] for k in range(1, len(ids) + 1)]


def test_a_streams_pieces_are_never_taken_back(letters):
    """`TextStream`, token by token: a half-written UTF-8 character, a stop string and the tail
    that may become one wait; each piece extends the last, and the answer's text the pieces."""
    from asyncrl.rl.agents.stream import TextStream

    tok = letters[1]
    ids = tok("a\u00e9 b STOP c", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("a\u00e9 b STOP c".encode())  # byte-level: the accent is two tokens
    stream = TextStream(tok, [tok.eos_token_id], ["STOP"], tools=False)
    pieces = [stream.update(ids[:k]) for k in range(1, len(ids) + 1)]
    assert [p for p in pieces if p] == ["a", "\u00e9", " ", "b", " "]
    assert stream.finish("a\u00e9 b ") == "" and stream.finish("other") is None
    tools = TextStream(tok, [tok.eos_token_id], [], tools=True)
    assert [tools.update(tok(t)["input_ids"]) for t in (" x ", " x <tool", " x y<tool_call>{")] == ["x", "", " y"]


async def test_a_stream_sends_text_as_it_is_generated(letters):
    """Through the real ``openai`` client: the first piece arrives while the generation is still
    going (it cannot finish until the client has read it); pieces never take back what was sent:
    a stop string and a ``<tool_call>`` being written are held back, the call goes out parsed at
    the end; the pieces and the rest make the answer, its log-probs come with it, and the session
    records the call as without a stream. A refusal before any text keeps its status."""
    _, tok, fmt = letters
    script = 'ok then <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    ids = tok(script, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    first_read = asyncio.Event()
    sent_before_read: list[int] = []

    async def generate(prompts, n, params, progress=None):
        for k in range(1, len(ids) + 1):
            progress(0, ids[:k])
            if k == 3:  # "ok " so far: the client must have read a piece before generation goes on
                async with asyncio.timeout(30):
                    await first_read.wait()
                sent_before_read.append(k)
            await asyncio.sleep(0)
        return 4, [[Completion(ids, [-0.25] * len(ids), script, "stop")]]

    sampling = SamplingParams(max_new_tokens=128, stop_token_ids=fmt.stop_token_ids)
    server = OpenAIServer(generate, tok, sampling, max_context=512, max_calls=1)
    await server.start()
    session = server.open_session()
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    try:
        async with server.client(session.key) as client:
            stream = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "go"}], tools=tools, stream=True, logprobs=True
            )
            pieces, chunks = [], []
            async for chunk in stream:
                chunks.append(chunk)
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    first_read.set()
            with pytest.raises(openai.RateLimitError):  # its one call made: refused before any text, as a 429
                await client.chat.completions.create(
                    model="policy", stream=True, messages=[{"role": "user", "content": "go"}]
                )
    finally:
        await server.close()
    assert sent_before_read == [3] and pieces[:2] == ["o", "k"]  # a piece a token
    assert "".join(pieces) == "ok then" and not any("<" in p for p in pieces)
    [calls] = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert (calls[0].function.name, json.loads(calls[0].function.arguments)) == ("calc", {"x": 1})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert [
        t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ] == [-0.25] * len(ids)
    assert chunks[-1].usage.completion_tokens == len(ids)
    [call] = session.calls
    assert (call.token_ids, call.version) == (ids, 4)


async def test_turns_that_extend_each_other_are_one_sample_with_the_context_masked(endpoint):
    session = endpoint.server.open_session()
    messages = [{"role": "user", "content": "start"}]
    async with endpoint.client(session.key) as client:
        for turn in range(3):
            answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4 + turn)
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"more {turn}"},
            ]
    calls = session.calls
    assert [len(c.token_ids) for c in calls] == [4, 5, 6]
    [sample] = assemble(calls)
    assert sample.calls == 3 and sample.version == 3
    # Exactly the last call's prompt and answer, every generated token marked with its log-prob.
    assert sample.prompt_ids + sample.token_ids == calls[-1].prompt_ids + calls[-1].token_ids
    assert sample.prompt_ids == calls[0].prompt_ids
    actions = [(t, lp) for t, lp, m in zip(sample.token_ids, sample.logprobs, sample.action_mask) if m]
    assert actions == [(t, lp) for c in calls for t, lp in zip(c.token_ids, c.logprobs)]
    context = [t for t, m in zip(sample.token_ids, sample.action_mask) if not m]
    assert endpoint.tokenizer.decode(context) == (
        "<|im_end|>\n<|im_start|>user\nmore 0<|im_end|>\n<|im_start|>assistant\n"
        "<|im_end|>\n<|im_start|>user\nmore 1<|im_end|>\n<|im_start|>assistant\n"
    )
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.action_mask) if not m)


async def test_an_edited_history_gives_separate_samples(endpoint):
    session = endpoint.server.open_session()
    messages = [{"role": "user", "content": "start"}]
    async with endpoint.client(session.key) as client:
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        edited = first.choices[0].message.content[::-1] + "x"  # the agent rewrote the model's answer
        await client.chat.completions.create(
            model="policy",
            max_tokens=4,
            messages=messages + [{"role": "assistant", "content": edited}, {"role": "user", "content": "go on"}],
        )
    one, two = assemble(session.calls)
    assert (one.prompt_ids, one.token_ids, one.action_mask) == (
        session.calls[0].prompt_ids,
        session.calls[0].token_ids,
        [1] * 4,
    )
    assert (two.prompt_ids, two.token_ids, two.action_mask) == (
        session.calls[1].prompt_ids,
        session.calls[1].token_ids,
        [1] * 4,
    )


def test_assemble_continues_the_conversation_each_call_extends():
    a = SessionCall([1, 2], [3, 4], [-0.1, -0.2], 5, "stop")
    b = SessionCall([9], [8], [-0.3], 6, "stop")  # a second conversation of the same episode
    a2 = SessionCall([1, 2, 3, 4, 7], [6], [-0.4], 4, "length")
    first, second = assemble([a, b, a2])
    assert (first.token_ids, first.logprobs, first.action_mask, first.version) == (
        [3, 4, 7, 6],
        [-0.1, -0.2, 0.0, -0.4],
        [1, 1, 0, 1],
        4,
    )
    assert (second.prompt_ids, second.token_ids, second.calls) == ([9], [8], 1)


async def test_concurrent_sessions_keep_their_own_calls_and_share_a_batch(endpoint):
    sessions = [endpoint.server.open_session() for _ in range(3)]

    async def talk(i, session):
        async with endpoint.client(session.key) as client:
            return await client.chat.completions.create(
                model="policy", max_tokens=6, messages=[{"role": "user", "content": f"episode {i} " * (i + 1)}]
            )

    answers = await asyncio.gather(*(talk(i, s) for i, s in enumerate(sessions)))
    for i, (session, answer) in enumerate(zip(sessions, answers)):
        [call] = session.calls
        assert call.prompt_ids == template_ids(
            endpoint.tokenizer, [{"role": "user", "content": f"episode {i} " * (i + 1)}]
        )
        assert endpoint.tokenizer.decode(call.token_ids) == answer.choices[0].message.content
        # Batched with the others (left padding): the log-probs are still those of this prompt alone.
        torch.testing.assert_close(
            torch.tensor(call.logprobs),
            recomputed(endpoint.backend.model, call.prompt_ids, call.token_ids, 1.0),
            atol=1e-4,
            rtol=0,
        )
    assert sum(endpoint.batches) == 3 and len(endpoint.batches) < 3  # gathered into fewer backend calls


async def test_tool_calls_round_trip_through_the_template(endpoint):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "a + b",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
            },
        }
    ]
    # The model's side: a Hermes <tool_call> in its text comes back as OpenAI tool_calls.
    text = 'ok <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    answer = chat_answer([Completion([5] * 3, [-1.0] * 3, text, "stop")], 10, tools=True)
    parsed = openai.types.chat.ChatCompletion.model_validate(answer)  # the client's own types accept it
    call = parsed.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert parsed.choices[0].message.content == "ok" and parsed.choices[0].finish_reason == "tool_calls"
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    # The agent's side: its assistant tool call and the tool's result go back through the template.
    session = endpoint.server.open_session()
    messages = [
        {"role": "user", "content": "2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    async with endpoint.client(session.key) as client:
        await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=3)
    prompt = endpoint.tokenizer.decode(session.calls[0].prompt_ids)
    assert '{"name": "add", "description": "a + b"' in prompt  # the tools, as the template lists them
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    assert session.calls[0].prompt_ids == render_chat(endpoint.tokenizer, messages, tools)


def test_the_embedded_templates_compact_tool_calls_round_trip():
    """The embedded agent template writes a one-string-argument call as ``NAME KEY=VALUE`` (any
    other arguments as ``NAME JSON``), and the endpoint's compact parser gives back the very calls
    rendered; ill-formed blocks, Hermes's JSON form among them, stay plain text."""
    from asyncrl.rl.agents.chat import compact_calls
    from asyncrl.rl.model.tokenizer import AGENT_TAGS, agent_chat_template, build_tokenizer

    tok = build_tokenizer(AGENT_TAGS)
    tok.chat_template = agent_chat_template()
    assert compact_calls(tok) and not compact_calls(build_tokenizer())
    arguments = [
        ("calculator", {"expression": "47 * 38"}),
        ("calculator", {"expression": "a = b"}),  # "=" in the value
        ("calculator", {"expression": ""}),
        ("add", {"a": 2, "b": 3}),  # not one string: JSON
        ("say", {"text": " padded "}),  # outer whitespace would be stripped: JSON
        ("say", {"not a key": "x"}),  # a key that is no identifier: JSON
        ("ping", {}),
        ("raw", "not json"),  # arguments that are no JSON object stay a string
        ("say", {"text": "a </tool_call> b"}),  # the closing tag in the value: JSON, read to its end
        ("say", {"text": "a", "then": "<tool_call>x=1</tool_call>"}),
        ("raw", "</tool_call>"),
    ]
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)},
        }
        for i, (n, a) in enumerate(arguments)
    ]
    question = {"role": "user", "content": "47 * 38 = ?"}
    for i in range(len(calls) + 1):  # each call alone, then all of them in one message
        sent = calls[i : i + 1] if i < len(calls) else calls
        ids = render_chat(
            tok, [question, {"role": "assistant", "content": "", "tool_calls": sent}], None, generation_prompt=False
        )
        prompt = render_chat(tok, [question], None)
        text = tok.decode(ids[len(prompt) : -1])  # the model's turn without its eos
        content, parsed = parse_tool_calls(text, compact=True)
        assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in parsed] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in sent
        ], text
    one = render_chat(
        tok, [question, {"role": "assistant", "content": "", "tool_calls": calls[:1]}], None, generation_prompt=False
    )
    assert tok.decode(one).endswith("<tool_call>calculator expression=47 * 38</tool_call><|im_end|>")
    hermes = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
    for bad in [
        "<tool_call>calculator</tool_call>",  # no arguments
        "<tool_call>calculator 1 + 2</tool_call>",  # no key, no JSON
        '<tool_call>calculator {"expression": </tool_call>',  # broken JSON
        "<tool_call>calculator 5</tool_call>",  # JSON, not an object or a string
        "<tool_call>two words x=1</tool_call>",  # "words x" is no key
        "<tool_call>calculator expression=1 + 2",  # never closed
        hermes,
    ]:
        assert parse_tool_calls(f"ok {bad}", compact=True) == (f"ok {bad}", []), bad
    assert parse_tool_calls(hermes)[1][0]["function"]["name"] == "calculator"  # other templates: Hermes's form


TOOLS = [{"type": "function", "function": {"name": "say", "parameters": {"type": "object"}}}]


def test_a_closing_tag_inside_a_calls_json_arguments_round_trips_through_hermess_template():
    """A JSON string may hold ``</tool_call>``: an earlier call with it, rendered into the next
    prompt by the (Hermes-form) template and read back as the model would write it, is the call
    sent, and the text after the block stays content."""
    from asyncrl.rl.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE  # the letters model's: Hermes's form
    arguments = json.dumps({"text": "a </tool_call> b", "more": ["</tool_call>", "<tool_call>"]})
    sent = [{"id": "call_0", "type": "function", "function": {"name": "say", "arguments": arguments}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": sent}]
    ids = render_chat(tok, messages, TOOLS, generation_prompt=False)
    text = tok.decode(ids[len(render_chat(tok, messages[:1], TOOLS)) :], skip_special_tokens=True)
    assert "a </tool_call> b" in text, text  # the template wrote the tag into the block's JSON
    content, parsed = parse_tool_calls(text + " done")
    assert content == "done" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
        ("say", json.loads(arguments))
    ], text
    # A block whose JSON does not close before its tag stays text, as any ill-formed block does.
    broken = '<tool_call>{"name": "say", "arguments": {"text": "a</tool_call> b"}</tool_call>'
    assert parse_tool_calls(broken) == (broken, [])


async def test_requests_without_the_token_or_a_live_session_are_refused(endpoint):
    import aiohttp

    session = endpoint.server.open_session()
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with endpoint.client(session.key, key="not-the-token") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(**body)
    async with aiohttp.ClientSession() as http:
        async with http.post(endpoint.server.base_url() + "/chat/completions", json=body) as response:
            assert response.status == 401  # no key at all
        async with http.get(endpoint.server.base_url() + "/models") as response:
            assert response.status == 401
    async with endpoint.client("no-such-session") as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(**body)
    endpoint.server.close_session(session.key)
    async with endpoint.client(session.key) as client:
        with pytest.raises(openai.NotFoundError):  # the episode ended: nothing more is recorded
            await client.chat.completions.create(**body)
    async with endpoint.client() as client:
        with pytest.raises(openai.BadRequestError, match="role"):
            await client.chat.completions.create(model="policy", messages=[{"role": "wizard", "content": "hi"}])
    assert endpoint.batches == [] and endpoint.server.host == "127.0.0.1"


async def test_a_hung_or_raising_agent_loses_its_episode_only(endpoint):
    async def agent(problem, client):
        answer = await client.chat.completions.create(
            model="policy", max_tokens=3, messages=[{"role": "user", "content": problem}]
        )
        if problem == "raise":
            raise RuntimeError("the agent's own bug")
        if problem == "hang":
            await asyncio.sleep(3600)
        return float(len(answer.choices[0].message.content))

    calls = UserCalls("agent", timeout_s=3.0, max_failure_rate=1.0)
    runner = AgentRunner(FunctionAgent.of(agent)(), endpoint.server, calls)
    groups = await asyncio.wait_for(runner.run(["fine", "raise", "hang"], 2), 30)
    fine, raised, hung = groups
    assert [s.reward for s in fine.samples] == [3.0, 3.0] and {s.error for s in fine.samples} == {""}
    # The failed episodes' model calls are kept, scored 0 with their error kind, as a failed step's are.
    assert [(s.reward, s.error) for s in raised.samples] == [(0.0, "raised")] * 2
    assert [(s.reward, s.error) for s in hung.samples] == [(0.0, "timeout")] * 2
    assert calls.failures == 4 and "the agent's own bug" in calls.first_traceback
    assert endpoint.server.sessions == {}  # every episode's session closed, however it ended
    for group in groups:  # the shared prompt plus each completion is exactly what the model saw and wrote
        for sample in group.samples:
            assert len(sample.token_ids) == len(sample.logprobs) == len(sample.action_mask)
            assert sum(sample.action_mask) == 3
    async with endpoint.client() as client:  # the endpoint goes on serving
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    calls.close()


def test_an_async_function_is_an_agent_task_and_a_sync_one_is_refused(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text(
        "async def my_agent(problem, client):\n    return 1.0\n\ndef not_async(problem, client):\n    return 1.0\n"
    )
    cls = task_class(f"{path}:my_agent")
    assert issubclass(cls, FunctionAgent) and cls.task_name() == "my_agent"
    with pytest.raises(TaskLoadError, match="nor an agent"):
        task_class(f"{path}:not_async")


AGENT_FILE = '''
async def agent(problem, client):
    """Two turns in its own message list; the reward: letters in the second answer."""
    messages = [{"role": "user", "content": problem["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return float(second.choices[0].message.content.count("a"))
'''


async def test_a_sampler_actor_trains_an_agent_file_and_serves_its_endpoint(letters, tmp_path):
    """The sampler actor in its own process: an agent named FILE.py:function, problems from a data
    file, groups of its two-turn episodes as the trainer gets them, from two rollout streams at
    once (two paced streams, --sampler.streams 2); its root endpoint for others, whose URL and
    token ``asyncrl status RUN_DIR --endpoint`` prints (the token, and only it, is let in)."""
    from asyncrl import Supervisor
    from asyncrl.rl.config.run import DataConfig, RecoveryConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.driver.fleet.endpoints import sampler_endpoints
    from asyncrl.rl.driver.fleet.membership import Membership
    from asyncrl.rl.rollout import validate_group
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.tasks.loading import TaskSpec
    from sampler_support import ONE_THREAD
    from test_status import status_cli

    (tmp_path / "my_agent.py").write_text(AGENT_FILE)
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"question": f"question {i}"}) + "\n")
    path = letters[0].name_or_path
    spec = TaskSpec(f"{tmp_path}/my_agent.py:agent", data=str(tmp_path / "rows.jsonl"), score_timeout_s=60.0)
    async with Supervisor(call_timeout_s=60) as sup:
        sampler = await sup.spawn(
            SamplerActor,
            path,
            SamplerConfig(group_size=2, prompts_per_batch=1, max_new_tokens=MAX_NEW, backend="hf", streams=2),
            name="smp",
            kwargs=dict(task=spec, data=DataConfig(n_train=8, n_heldout=2)),
            env=ONE_THREAD,
        )

        async def stream() -> list:  # two at once, as the driver's two paced streams call it
            return [g async for g in sampler.rollouts(1)]

        groups = [g for got in await asyncio.gather(stream(), stream()) for g in got]
        served = await sampler.openai_endpoint()
        # what code outside the episodes is told to use (docs/agents.md): the run's status socket
        status = await sup.serve_status(tmp_path, progress=lambda: {"phase": "training"})
        membership = Membership([sampler], [0], recovery=RecoveryConfig(), log=lambda line: None)
        status.add_command("endpoint", lambda args: sampler_endpoints(membership, args))
        code, out, err = await status_cli(str(tmp_path), "--endpoint", "--json")
        assert (code, err) == (0, ""), err
        assert json.loads(out) == {"endpoints": [{"sampler": "smp", **served}]}
        async with openai.AsyncOpenAI(base_url=served["base_url"], api_key=served["token"], max_retries=0) as client:
            answer = await client.chat.completions.create(
                model="policy", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        async with openai.AsyncOpenAI(base_url=served["base_url"], api_key="not-the-token", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        stats = await sampler.stats()
    assert served["base_url"].startswith("http://127.0.0.1:") and len(answer.choices[0].message.content) == 2
    assert len(groups) == 2 and stats.completions == 2 * 2 * 2 + 1  # 2 problems x 2 episodes x 2 calls, + 1
    assert groups[0].prompt_id != groups[1].prompt_id  # two streams at once walk the one problem order
    tok = letters[1]
    for group in groups:
        validate_group(group)
        assert group.group_size == 2 and group.version == 0
        assert tok.decode(group.prompt_ids).startswith("<|im_start|>user\nquestion ")
        for ids, mask, lps, reward in zip(
            group.completion_ids, group.action_mask, group.behaviour_logprobs, group.rewards
        ):
            assert sum(mask) == 3 + 4  # both turns' tokens are actions: the second extended the first
            second = tok.decode([t for t, m in zip(ids, mask) if m][3:])
            assert reward == second.count("a")
            assert all((lp < 0) == bool(m) for lp, m in zip(lps, mask))
            assert tok.decode(group.prompt_ids + ids).count("<|im_start|>assistant\n") == 2


def test_the_held_out_evaluation_runs_an_agent_greedily(letters):
    """The trainer's evaluation of an agent: its episodes against an endpoint over the model's own
    ``generate``, greedy (the same question answered twice alike), failures scoring 0 and counted by
    kind, the metrics of its scores averaged over every episode (a failed one counts 0), and the
    failed episodes counted by what they raised, a line per kind (messages that differ by a number
    are one kind): a conversation past the model's positions is the endpoint's 400, as the agent's
    client raised it."""
    from asyncrl.rl.agents.chat import render_chat
    from asyncrl.rl.model.evaluation import evaluate
    from asyncrl.rl.tasks.base import Score

    async def agent(problem, client):
        texts = []
        for _ in range(2):
            question = problem if problem != "long" else "a" * 200
            answer = await client.chat.completions.create(
                model="policy", max_tokens=5, messages=[{"role": "user", "content": question}]
            )
            texts.append(answer.choices[0].message.content)
        if problem.startswith("raise"):
            raise ValueError(f"no {problem}\nsecond line")
        return Score(
            1.0, correct=texts[0] == texts[1] and texts[0].isalpha(), metrics={"long": float(problem == "two")}
        )

    model, tok, fmt = letters
    task = FunctionAgent.of(agent)()
    problems = ["one", "two", "raise", "raise 2", "long"]
    found = evaluate(model, tok, fmt, problems, task=task, greedy=True, max_new_tokens=8, max_context=128)
    assert (found.solve_rate, found.metrics, found.errors) == (2 / 5, {"long": 1 / 5}, {"raised": 3})
    long = len(render_chat(tok, [{"role": "user", "content": "a" * 200}], None))
    assert found.failures == {
        "raised ValueError: no raise": 2,
        f"raised openai.BadRequestError: Error code: 400 - the prompt has {long} tokens, and the model reads at "
        "most 128: shorten the conversation": 1,
    }


def test_the_held_out_evaluations_endpoint_answers_log_probs_as_a_samplers_does(letters):
    """An agent sees the same answer in held-out evaluation as in training. Seen: the evaluation's
    endpoint (over ``model.generate``) gave 0 alternatives for ``top_logprobs=2`` and log-probs of 0,
    where a sampler's gives 2 and the sampling log-probs. Here one greedy question through each:
    the same tokens, log-probs and alternatives (to float error: two implementations of decoding)."""
    from asyncrl.rl.model.evaluation import evaluate

    answers: list = []

    async def agent(problem, client):
        answer = await client.chat.completions.create(
            model="policy", max_tokens=5, messages=[{"role": "user", "content": problem}], logprobs=True, top_logprobs=2
        )
        answers.append(answer.choices[0].logprobs.content)
        return 1.0

    model, tok, fmt = letters
    task = FunctionAgent.of(agent)()
    assert evaluate(model, tok, fmt, ["hi"], task=task, greedy=True, max_new_tokens=8).solve_rate == 1.0

    async def on_a_sampler():
        backend = HFBackend(model, tokenizer=tok)
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=fmt.stop_token_ids)

        async def generate(prompts, n, params, progress=None):
            return 0, await backend.generate(prompts, n, params, progress)

        server = OpenAIServer(generate, tok, greedy)
        await server.start()
        calls = UserCalls("agent", timeout_s=60.0, max_failure_rate=0.0)
        try:
            await AgentRunner(task, server, calls).episodes(["hi"], 1)
        finally:
            await server.close()
            backend.close()
            calls.close()

    asyncio.run(on_a_sampler())
    held_out, sampler = answers
    assert len(held_out) == len(sampler) == 5
    assert all(len(t.top_logprobs) == 2 for t in held_out + sampler)
    assert [t.token for t in held_out] == [t.token for t in sampler]
    assert [[a.token for a in t.top_logprobs] for t in held_out] == [[a.token for a in t.top_logprobs] for t in sampler]
    flat = [[t.logprob, *(a.logprob for a in t.top_logprobs)] for t in held_out]
    torch.testing.assert_close(
        torch.tensor(flat), torch.tensor([[t.logprob, *(a.logprob for a in t.top_logprobs)] for t in sampler])
    )
    assert all(t.logprob < 0 for t in held_out)  # not the 0.0 of a generation that kept none


async def test_the_example_agents_run_against_the_endpoint(endpoint):
    """examples/agent_calculator.py (tools) and examples/agent_guess.py (its own message list), as
    a run loads them; the letters model never calls a tool nor names a number, so both score 0
    after using every turn they allow."""
    from asyncrl.rl.tasks.loading import TaskSpec, load_task

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    calc = load_task(TaskSpec(f"{examples}/agent_calculator.py:CalculatorAgent"))
    guess = load_task(TaskSpec(f"{examples}/agent_guess.py:guess_number", data=f"{examples}/data/guess_numbers.jsonl"))
    calls = UserCalls("examples", timeout_s=60.0, max_failure_rate=0.0)
    [calc_group] = await AgentRunner(calc, endpoint.server, calls).run(calc.problems()[:1], 1)
    [guess_group] = await AgentRunner(guess, endpoint.server, calls).run(guess.data[:1], 1)
    # a conversation past the model's positions is refused as OpenAI refuses it (400, the code an
    # agent tests); the calculator agent ends that episode unanswered, scored 0, not as a failure
    endpoint.server.max_context = 16
    try:
        async with endpoint.client() as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        [(_, overflowed)] = await AgentRunner(calc, endpoint.server, calls).episodes(calc.problems()[:1], 1)
    finally:
        endpoint.server.max_context = 512
    assert (refused.value.status_code, refused.value.code) == (400, "context_length_exceeded")
    assert (overflowed.error, overflowed.value.reward, overflowed.value.metrics["context_exceeded"]) == ("", 0.0, 1.0)
    assert calls.failures == 0
    [sample] = calc_group.samples
    assert (sample.reward, sample.metrics) == (
        0.0,
        {"calls": 1.0, "tool_used": 0.0, "tool_used_correctly": 0.0, "context_exceeded": 0.0},
    )
    assert "calculator" in endpoint.tokenizer.decode(calc_group.prompt_ids)  # the tool, as the template lists it
    [sample] = guess_group.samples  # five guesses, one conversation: one sample
    assert (sample.reward, sample.metrics["calls"], sample.metrics["guesses"]) == (0.0, 5.0, 5.0)
    assert "Give a number." in endpoint.tokenizer.decode(
        [t for t, m in zip(sample.token_ids, sample.action_mask) if not m]
    )
    calls.close()


async def test_the_agent_in_docs_agents_md_runs(endpoint, tmp_path):
    """The ~30-line agent of docs/agents.md, as written there, loaded by its --task.name spelling."""
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "agents.md")
    code = open(docs).read().split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_agent.py").write_text(code)
    agent = task_class(f"{tmp_path}/my_agent.py:my_agent")()
    calls = UserCalls("docs", timeout_s=60.0, max_failure_rate=0.0)
    [group] = await AgentRunner(agent, endpoint.server, calls).run([{"question": "2 + 3?", "answer": 5}], 2)
    assert calls.failures == 0 and [s.reward for s in group.samples] == [0.0, 0.0]  # letters are no answer
    assert "calculator" in endpoint.tokenizer.decode(group.prompt_ids)
    calls.close()


async def test_a_session_answers_429_past_its_model_calls(letters):
    e = Endpoint(letters, max_calls=2)
    await e.server.start()
    session = e.server.open_session()
    try:
        async with e.client(session.key) as client:
            for _ in range(2):
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
            with pytest.raises(openai.RateLimitError, match="may make 2 model calls"):
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        await e.server.close()
        e.backend.close()
    assert len(session.calls) == 2


def test_an_agent_run_needs_the_agents_extra():
    from asyncrl.rl.driver.preflight import AGENT_MODULES, missing_modules

    assert missing_modules(AGENT_MODULES) == []  # installed here
    assert missing_modules(("aiohttp", "no_such_module_xyz")) == ["no_such_module_xyz"]


@pytest.mark.parametrize("batch", [True, False])
async def test_closing_answers_a_request_in_flight_at_once(letters, batch):
    """A sampler that stops while an agent's request waits for generation (here: the backend
    paused, as for a weight sync): the request is answered 503 and the close returns, both at once."""
    e = Endpoint(letters, batch=batch)
    await e.server.start()
    await e.backend.pause()
    try:
        async with e.client() as client:
            asking = asyncio.ensure_future(
                client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            )
            await asyncio.sleep(0.5)
            assert not asking.done()
            loop = asyncio.get_running_loop()
            start = loop.time()
            await asyncio.wait_for(e.server.close(), 10)
            with pytest.raises((openai.InternalServerError, openai.APIConnectionError)):
                await asyncio.wait_for(asking, 10)
            assert loop.time() - start < 5
    finally:
        await e.server.close()
        e.backend.close()


async def test_the_listener_takes_a_burst_of_connections_while_the_loop_is_busy(endpoint):
    """Every episode of a round connects at once, and the loop may be busy meanwhile (the held-out
    evaluation's generation; an agent's own work): the kernel must queue them all. Seen: a listen
    backlog of 128 left 43 of 800 evaluation episodes with a connection error, scored 0."""
    import socket
    import threading
    import time

    connected, failed = [], []

    def connect_all():
        for _ in range(BURST):
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect(("127.0.0.1", endpoint.server.port))
                connected.append(s)
            except OSError:
                failed.append(s)

    BURST = 600
    thread = threading.Thread(target=connect_all)
    thread.start()
    time.sleep(2.0)  # the loop does not accept meanwhile: the kernel's queue alone holds them
    thread.join(30)
    for s in connected + failed:
        s.close()
    assert not failed and len(connected) == BURST
    async with endpoint.client() as client:  # and the endpoint serves on
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=1)


async def test_the_warm_start_lays_out_an_agents_demonstration_as_its_episode():
    """The embedded model for an agent (examples/agent_calculator.py): its template renders the
    tool calls and results, and each demonstration's training row is, token for token and mask for
    mask, the sample the endpoint assembles when the model writes the demonstrated turns: the real
    agent and ``openai`` client, against an endpoint whose "model" replays the row's labels."""
    from asyncrl.rl.model import warm_start
    from asyncrl.rl.model.demonstrations import agent_demonstration_row
    from asyncrl.rl.model.tokenizer import AGENT_TAGS, build_tokenizer
    from asyncrl.rl.tasks.loading import TaskSpec, load_task

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    agent = load_task(TaskSpec(f"{examples}/agent_calculator.py:CalculatorAgent"))
    tok = build_tokenizer(AGENT_TAGS)
    tok.chat_template = warm_start.chat_template(agent)
    problems = agent.problems()[:6]  # sums and differences answered directly, a product through the tool
    rows = {p: agent_demonstration_row(tok, agent, agent.demonstration(p)) for p in problems}
    assert {len(agent.demonstration(p)) for p in problems} == {2, 4}

    async def replay(
        prompts, n, params, progress=None
    ):  # each prompt's next demonstrated turn, as a backend returns it
        out = []
        for prompt in prompts:
            ids, labels, _ = next(r for r in rows.values() if r[0][: len(prompt)] == prompt)
            end = len(prompt)
            while end < len(ids) and labels[end] != -100:
                end += 1
            turn = ids[len(prompt) : end]
            assert turn and turn[-1] == tok.eos_token_id
            out.append([Completion(turn, [-0.5] * len(turn), tok.decode(turn[:-1], skip_special_tokens=True), "stop")])
        return 0, out

    server = OpenAIServer(
        replay, tok, SamplingParams(max_new_tokens=80, stop_token_ids=[tok.eos_token_id]), max_calls=agent.max_calls
    )
    await server.start()
    calls = UserCalls("layout", timeout_s=60.0, max_failure_rate=0.0)
    try:
        for problem, (ids, labels, _) in rows.items():
            [group] = await AgentRunner(agent, server, calls).run([problem], 1)
            [sample] = group.samples
            assert (sample.reward, sample.metrics["calls"]) == (1.0, 1 + (len(agent.demonstration(problem)) > 2))
            assert group.prompt_ids + sample.token_ids == ids
            assert [0] * len(group.prompt_ids) + sample.action_mask == [int(label != -100) for label in labels]
    finally:
        await server.close()
        calls.close()
    tool_row = next(r for p, r in rows.items() if len(agent.demonstration(p)) == 4)
    assert "<tool_response>" in tok.decode(tool_row[0]) and tok.convert_tokens_to_ids("<tool_call>") in tool_row[0]


@pytest.mark.parametrize("text_first", [False, True])
async def test_a_stream_whose_client_goes_away_is_a_quiet_end(letters, caplog, text_first):
    """An agent's streaming request whose client goes away (its episode ended, or it gave up)
    while the generation goes on, before any text or after a piece of it: a normal end. Seen:
    one aiohttp traceback a request ("Cannot write to closing transport") when the generation
    finished and the answer was written to the closed connection. Nothing above debug is logged,
    the session counts no call in flight, and records none (its client never got the answer)."""
    import logging

    import aiohttp

    _, tok, fmt = letters
    ids = tok("abc", add_special_tokens=False)["input_ids"]
    started, release = asyncio.Event(), asyncio.Event()

    async def generate(prompts, n, params, progress=None):
        if text_first:
            progress(0, ids[:1])
        started.set()
        await release.wait()
        progress(0, ids)
        return 4, [[Completion(ids, [-0.5] * len(ids), "abc", "length")]]

    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=fmt.stop_token_ids)
    server = OpenAIServer(generate, tok, sampling, max_context=512, batch=False)
    await server.start()
    session = server.open_session()
    caplog.set_level(logging.DEBUG)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "stream": True}
            headers = {"Authorization": f"Bearer {server.token}"}
            url = server.base_url(session.key) + "/chat/completions"

            async def ask():
                async with http.post(url, json=body, headers=headers) as response:
                    await response.content.readany()
                    await asyncio.Event().wait()  # read no further: the client goes away mid-answer

            asking = asyncio.ensure_future(ask())
            async with asyncio.timeout(30):
                await started.wait()
            asking.cancel()  # the agent's episode ends: its connection closes
        async with asyncio.timeout(30):
            while any(c.transport for c in server._runner.server.connections):  # the server saw it go
                await asyncio.sleep(0.01)
        release.set()  # the generation ends (if it still runs), and its request's handler with it
        async with asyncio.timeout(30):
            while server._runner.server.connections:
                await asyncio.sleep(0.01)
    finally:
        await server.close()
    loud = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING or r.levelno > logging.DEBUG and r.name.startswith(("aiohttp", "asyncrl"))
    ]
    assert not loud, [r.getMessage() for r in loud]
    assert len([r for r in caplog.records if "asyncrl" in r.name]) <= 1
    assert session.in_flight == 0 and session.calls == []


async def test_a_stream_that_finds_its_connection_closing_ends_quietly(letters, caplog, monkeypatch):
    """The same end where the handler writes before aiohttp has told it the connection is gone (a
    reset read in the same loop turn; a server shutting down closes the transport first): aiohttp's
    write raises ``ClientConnectionResetError``, as here from the second event on. One debug line,
    no traceback, the session's call counted back."""
    import logging

    import aiohttp
    from aiohttp import web

    _, tok, fmt = letters
    ids = tok("abc", add_special_tokens=False)["input_ids"]
    real_write, writes = web.StreamResponse.write, []

    async def write(self, data):
        writes.append(data)
        if len(writes) > 1:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await real_write(self, data)

    async def generate(prompts, n, params, progress=None):
        for k in range(1, len(ids) + 1):
            progress(0, ids[:k])
            await asyncio.sleep(0)
        return 4, [[Completion(ids, [-0.5] * len(ids), "abc", "length")]]

    monkeypatch.setattr(web.StreamResponse, "write", write)
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=fmt.stop_token_ids)
    server = OpenAIServer(generate, tok, sampling, max_context=512, batch=False)
    await server.start()
    session = server.open_session()
    caplog.set_level(logging.DEBUG)
    try:
        async with server.client(session.key) as client:
            stream = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "go"}], stream=True
            )
            chunks = [c async for c in stream]  # the first piece, then the answer ends
    finally:
        await server.close()
    loud = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING or r.levelno > logging.DEBUG and r.name.startswith(("aiohttp", "asyncrl"))
    ]
    assert not loud, [r.getMessage() for r in loud]
    assert [r.getMessage() for r in caplog.records if r.name == "asyncrl.rl.agents.sse"] == [
        "a streamed answer ended early, its connection closed (Cannot write to closing transport)"
    ]
    assert session.in_flight == 0 and len(writes) == 2 and len(chunks) == 1


def test_every_metric_the_runner_adds_to_an_agents_samples_is_in_docs_agents_md():
    """metrics.jsonl's ``task/<key>`` of an agent run are its `Score`'s metrics and the ones the
    runner adds itself; each of the latter is named in docs/agents.md. Seen: ``task/calls`` in
    every agent run's metrics.jsonl, and nowhere in the docs."""
    from asyncrl.rl.agents.runner import _group
    from asyncrl.rl.agents.session import AgentSample
    from asyncrl.rl.tasks.base import Score
    from asyncrl.rl.tasks.scoring import Outcome

    sample = AgentSample([1, 2], [3, 4], [-0.5, -0.5], [1, 1], version=0, calls=2)
    group = _group([(sample, Outcome(Score(1.0)))])  # a Score with no metrics of its own
    added = sorted(group.samples[0].metrics)
    assert added == ["calls"]
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "agents.md"), encoding="utf-8") as f:
        docs = f.read()
    assert [k for k in added if f"`task/{k}`" not in docs] == []


@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("end", ["episodes cancelled", "server closes"])
async def test_the_end_of_a_run_under_open_streams_is_quiet_and_every_episode_accounted_for(
    letters, caplog, batch, end
):
    """A run's end as a streaming agent's episodes meet it, some streams past a first piece of
    text, one before any: the rollout stream is dropped (its episodes cancelled, their clients
    gone, while the backend generates on), or the sampler's endpoint closes under them. Seen:
    7-47 aiohttp tracebacks ("Cannot write to closing transport") around the "GRPO finished"
    summary, at 16 groups a step. Nothing above debug is logged, no traceback; every session is
    closed with no call in flight and none recorded (no agent saw an answer); where the server
    closed, each episode ends as its client tells its agent, a failure scored 0 and counted."""
    import logging

    _, tok, fmt = letters
    ids = tok("abc", add_special_tokens=False)["input_ids"]
    pieces, rows, sent, release = [], itertools.count(), [], asyncio.Event()

    async def generate(prompts, n, params, progress=None):
        for row in range(len(prompts) * n):
            if next(rows):  # the first row sends nothing before the end
                progress(row, ids[:1])
                sent.append(row)
        await release.wait()  # the backend generates on (a gathered batch, for its other rows)
        return 4, [[Completion(ids, [-0.5] * len(ids), "abc", "length")] * n for _ in prompts]

    async def agent(problem, client):
        stream = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": problem}], stream=True
        )
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content)
        return 1.0

    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=fmt.stop_token_ids)
    server = OpenAIServer(generate, tok, sampling, max_context=512, batch=batch)
    await server.start()
    connections = server._runner.server.connections
    calls = UserCalls("agent", timeout_s=60.0, max_failure_rate=1.0)
    caplog.set_level(logging.DEBUG)
    try:
        episodes = asyncio.ensure_future(AgentRunner(FunctionAgent.of(agent)(), server, calls).episodes(["go"], 3))
        async with asyncio.timeout(30):
            # every request is in, the generation has given a piece to every row but the first (in a
            # batch the requests are in before it begins: waiting for them alone raced it), and each
            # stream given a piece has read it
            while sum(s.in_flight for s in server.sessions.values()) < 3 or len(sent) < 2 or len(pieces) < len(sent):
                await asyncio.sleep(0.01)
            sessions = list(server.sessions.values())
            if end == "server closes":
                await server.close()
                outcomes = [outcome for _, outcome in await episodes]
            else:
                episodes.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await episodes
                while any(c.transport for c in connections):  # the server saw every client go
                    await asyncio.sleep(0.01)
                release.set()  # the generation ends, and what is left of its requests' handlers with it
                while connections or any(s.in_flight for s in sessions):
                    await asyncio.sleep(0.01)
    finally:
        await server.close()
        calls.close()
    loud = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING or r.levelno > logging.DEBUG and r.name.startswith(("aiohttp", "asyncrl"))
    ]
    assert not loud, [(r.name, r.getMessage()) for r in loud]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert len(sessions) == 3 and all(s.closed and s.in_flight == 0 and s.calls == [] for s in sessions)
    assert server.sessions == {}
    assert pieces == ["a"] * len(sent) and len(sent) == 2  # streams were open, past their first piece
    if end == "server closes":
        assert [o.error for o in outcomes] == ["raised"] * 3 and calls.failures == 3
