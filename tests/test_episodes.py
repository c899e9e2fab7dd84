"""The episode runner (tasks/episodes.py), user calls under deadlines (tasks/scoring.py), the tool
format (tasks/tools.py) and `PromptFormat.reply_ids`: a scripted policy (a fake ``generate`` that
writes planned turns) drives environments over several turns; then the HF backend end to end on a
tiny random model, with stop strings."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import torch

from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.model.policy import PromptFormat
from asyncrl.rl.model.tokenizer import build_tokenizer
from asyncrl.rl.tasks.base import Environment, Message, Prompt, Reply, Score, Task
from asyncrl.rl.tasks.episodes import EpisodeRunner, Sample
from asyncrl.rl.tasks.scoring import TaskFailureError, UserCalls
from asyncrl.rl.tasks.tools import CALC, calculator, parse_tool_call, tool_result, tool_stops
from sampler_support import recomputed

pytest_plugins = ["sampler_support"]  # its fixtures: tiny_path, policy

TOK = build_tokenizer()
EOS = TOK.eos_token_id
FMT = PromptFormat("compact", TOK, [EOS], 24)
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[EOS])


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def lp(position: int) -> float:
    """The scripted policy's log-prob of the token at ``position`` of the whole context: any
    misalignment between tokens and log-probs shows."""
    return -(position + 1) / 1000


class Script:
    """A fake `Generate`: the model's turns per prompt text, in order; the turn a context is at is
    the number of tool results in it. Emulates a backend: stops at a stop token or stop string
    (text before it), or at ``max_new_tokens``."""

    def __init__(self, turns: dict[str, list[str]]):
        self.turns = turns
        self.calls: list[tuple[list[list[int]], int, SamplingParams]] = []

    async def __call__(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        self.calls.append((prompts, n, params))
        out = []
        for p in prompts:
            context = TOK.decode(p)
            key = next(k for k in self.turns if context.startswith(k))
            planned = self.turns[key][context.count("<result>")]
            out.append([self._complete(len(p), ids(planned), params) for _ in range(n)])
        return out

    @staticmethod
    def _complete(start: int, planned: list[int], params: SamplingParams) -> Completion:
        for k in range(1, len(planned) + 1):
            got = planned[:k]
            text = TOK.decode(got, skip_special_tokens=True)
            logprobs = [lp(start + i) for i in range(k)]
            if got[-1] in params.stop_token_ids:
                return Completion(got, logprobs, TOK.decode(got[:-1], skip_special_tokens=True), "stop")
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                return Completion(got, logprobs, text[: min(hits)], "stop")
            if k == params.max_new_tokens:
                return Completion(got, logprobs, text, "length")
        raise AssertionError(f"the script ran out of tokens: {TOK.decode(planned)!r}")


class CalcEnv(Environment):
    """A tool-use environment: ``<calc>..</calc>`` gets its value back; any other turn is the answer."""

    name = "calc_env"
    stop = tool_stops([CALC])
    max_turns = 4

    def prompt(self, problem):
        return problem["q"]

    def step(self, episode, completion):
        call = parse_tool_call(completion, [CALC])
        if call is not None:
            episode.state["calls"] = episode.state.get("calls", 0) + 1
            return Reply(tool_result(calculator(call.args)), metrics={"tool_calls": 1})
        return Reply(done=True, reward=1.0 if f"<answer>{episode.problem['a']}</answer>" in completion else 0.1)


P1, P2 = {"q": "2+3=", "a": 5}, {"q": "7*6=", "a": 42}
SCRIPT = {
    "2+3=": ["<calc>2+3</calc>", "so <calc>5*2</calc>", "<answer>5</answer><|im_end|>"],
    "7*6=": ["<answer>41</answer><|im_end|>"],
}


def runner(task, calls=None, **kw) -> EpisodeRunner:
    return EpisodeRunner(task, FMT, calls or UserCalls(task.task_name(), 5.0, 1.0), **kw)


def check_alignment(prompt: str, s: Sample) -> None:
    """Model tokens carry the script's log-prob of their context position, environment tokens 0."""
    start = len(ids(prompt))
    assert len(s.token_ids) == len(s.logprobs) == len(s.action_mask)
    for i, (m, got) in enumerate(zip(s.action_mask, s.logprobs)):
        assert got == (lp(start + i) if m else 0.0)


# --- environments over several turns -------------------------------------------------------------


async def test_three_turns_lay_out_model_and_environment_tokens():
    script = Script(SCRIPT)
    [[a, b], [c, d]] = await runner(CalcEnv()).run([P1, P2], 2, GREEDY, script)
    assert a == b and c == d
    turns = [
        "<calc>2+3</calc>",
        "<result>5</result>",
        "so <calc>5*2</calc>",
        "<result>10</result>",
        "<answer>5</answer><|im_end|>",
    ]
    assert a.token_ids == [t for turn in turns for t in ids(turn)]
    assert a.action_mask == [int(i % 2 == 0) for i, turn in enumerate(turns) for _ in ids(turn)]
    check_alignment("2+3=", a)
    assert a.reward == 1.0 and a.correct and a.error == "" and a.finish_reason == "stop"
    assert a.metrics == {"tool_calls": 2.0, "turns": 3.0, "episodes_truncated": 0.0}
    assert a.text == "<calc>2+3</calc><result>5</result>so <calc>5*2</calc><result>10</result><answer>5</answer>"
    assert c.token_ids == ids(SCRIPT["7*6="][0]) and c.action_mask == [1] * len(c.token_ids)
    assert c.reward == 0.1 and not c.correct and c.metrics["turns"] == 1.0
    # Turn 1: one call, n per prompt, the environment's stop strings added; later turns: one call
    # over the open episodes' whole contexts, one completion each.
    (p1, n1, s1), (p2, n2, s2), (p3, n3, s3) = script.calls
    assert n1 == 2 and p1 == [ids("2+3="), ids("7*6=")] and s1 == msgspec.structs.replace(GREEDY, stop=["</calc>"])
    assert n2 == n3 == 1 and len(p2) == len(p3) == 2
    assert p2[0] == ids("2+3=" + "".join(turns[:2])) and p3[1] == ids("2+3=" + "".join(turns[:4]))


async def test_step_sees_the_turn_text_with_its_stop_string_and_the_episode_so_far():
    seen = []

    class Recorder(CalcEnv):
        def step(self, episode, completion):
            seen.append((completion, [m.role for m in episode.turns], episode.turns[-1].content))
            episode.turns.clear()  # the environment's own business: the context must not change
            return super().step(episode, completion)

    [[s]] = await runner(Recorder()).run([P1], 1, GREEDY, Script(SCRIPT))
    assert [t for t, _, _ in seen] == ["<calc>2+3</calc>", "so <calc>5*2</calc>", "<answer>5</answer>"]
    assert all(t == last for t, _, last in seen)
    assert seen[0][1] == ["assistant"] and s.reward == 1.0 and s.metrics["turns"] == 3.0


async def test_an_episode_is_truncated_after_max_turns():
    [[s]] = await runner(CalcEnv(), max_turns=2).run([P1], 1, GREEDY, Script(SCRIPT))
    assert s.reward == CalcEnv.truncated_reward and not s.correct
    assert s.metrics == {"tool_calls": 2.0, "turns": 2.0, "episodes_truncated": 1.0}
    assert s.action_mask[-1] == 1  # ends with the model's turn: no reply nobody answers
    assert TOK.decode(s.token_ids) == "<calc>2+3</calc><result>5</result>so <calc>5*2</calc>"


async def test_an_episode_is_truncated_where_the_context_ends():
    script = Script(SCRIPT)
    prompt, turn1, reply1 = (len(ids(t)) for t in ("2+3=", "<calc>2+3</calc>", "<result>5</result>"))
    room = 7  # turn 2 may write 7 tokens: it is cut by length (and CalcEnv takes "so <cal" for an answer)
    [[s]] = await runner(CalcEnv(), max_context=prompt + turn1 + reply1 + room).run([P1], 1, GREEDY, script)
    assert [c[2].max_new_tokens for c in script.calls] == [GREEDY.max_new_tokens, room]
    assert s.finish_reason == "length" and s.metrics["turns"] == 2.0 and s.reward == 0.1
    assert len(s.token_ids) == turn1 + reply1 + room
    check_alignment("2+3=", s)
    # A reply that would leave no room for the next turn ends the episode before it.
    [[t]] = await runner(CalcEnv(), max_context=prompt + turn1 + reply1).run([P1], 1, GREEDY, Script(SCRIPT))
    assert t.token_ids == ids("<calc>2+3</calc>") and t.metrics["episodes_truncated"] == 1.0


async def test_a_step_that_raises_or_returns_a_bad_value_ends_its_episode_with_reward_0():
    class Broken(CalcEnv):
        def step(self, episode, completion):
            if episode.problem is P2:
                return {"done": True}  # not a Reply
            if episode.model_turns == 2:
                raise RuntimeError("the sandbox is gone")
            return super().step(episode, completion)

    calls = UserCalls("broken", 5.0, 1.0)
    [[a], [b]] = await runner(Broken(), calls).run([P1, P2], 1, GREEDY, Script(SCRIPT))
    assert (a.reward, a.correct, a.error, a.metrics["turns"]) == (0.0, False, "raised", 2.0)
    assert (b.reward, b.error) == (0.0, "bad_value")
    assert calls.take_counts() == {"calls": 3, "raised": 1, "timeout": 0, "bad_value": 1}
    assert calls.first_traceback == (
        "step: step() returned a bad value: TaskInputError: step() must return a Reply, not dict"
    )


async def test_async_steps_and_scores():
    class AsyncEnv(CalcEnv):
        async def step(self, episode, completion):
            await asyncio.sleep(0.01)
            return CalcEnv.step(self, episode, completion)

    class AsyncTask(Task):
        def prompt(self, problem):
            return problem["q"]

        async def score(self, problem, completion):
            await asyncio.sleep(0.01)
            return Score(0.5, correct=True, metrics={"length": len(completion)})

    [[s]] = await runner(AsyncEnv()).run([P1], 1, GREEDY, Script(SCRIPT))
    assert s.reward == 1.0 and s.metrics["turns"] == 3.0
    [[t]] = await runner(AsyncTask()).run([P2], 1, GREEDY, Script(SCRIPT))
    assert (t.reward, t.correct, t.metrics) == (0.5, True, {"length": len("<answer>41</answer>")})
    assert t.action_mask == [] and t.text == "<answer>41</answer>"


# --- single-turn tasks and failing user code -------------------------------------------------------


class Scored(Task):
    """Scores by the problem's ``how``: a number, or a way to fail ("hang": until ``release``)."""

    name = "scored"
    release = threading.Event()

    def prompt(self, problem):
        return problem["q"]

    def score(self, problem, completion):
        how = problem["how"]
        if how == "raise":
            raise ValueError(f"no reward for {completion!r}")
        if how == "hang":
            self.release.wait(30)
        if how == "exit":
            raise SystemExit(3)
        return {"nan": float("nan"), "none": None, "str": "1.0", "inf": float("inf")}.get(how, how)


@pytest.fixture(autouse=True)
def hangs_until_released():
    Scored.release = threading.Event()
    yield
    Scored.release.set()  # whatever the test did, no thread of it stays hung


def problems(*hows) -> list[dict]:
    return [{"q": "7*6=", "how": h} for h in hows]


async def test_single_turn_is_one_generate_call_and_failures_score_0_by_kind():
    script, calls = Script(SCRIPT), UserCalls("scored", 0.3, 1.0)
    start = time.monotonic()
    groups = await runner(Scored(), calls).run(
        problems(1.0, "raise", "hang", "nan", "none", "str", "exit", 0.25), 2, GREEDY, script
    )
    try:
        assert time.monotonic() - start < 5  # the hung calls answered at their deadline
        assert len(script.calls) == 1 and script.calls[0][2] == GREEDY and script.calls[0][1] == 2
        got = [(s.reward, s.correct, s.error) for g in groups for s in g[:1]]
        assert got == [
            (1.0, True, ""),
            (0.0, False, "raised"),
            (0.0, False, "timeout"),
            (0.0, False, "bad_value"),
            (0.0, False, "bad_value"),
            (0.0, False, "bad_value"),
            (0.0, False, "raised"),
            (0.25, False, ""),
        ]
        assert all(g[0] == g[1] for g in groups)
        assert calls.take_counts() == {"calls": 16, "raised": 4, "timeout": 2, "bad_value": 6}
        assert calls.take_counts() == {"calls": 0, "raised": 0, "timeout": 0, "bad_value": 0}
        assert calls.hung == 2
    finally:
        Scored.release.set()
    assert await asyncio.to_thread(lambda: _wait(lambda: calls.hung == 0, 5.0))
    calls.close()


async def test_failures_are_counted_by_what_they_were_a_line_per_kind():
    """`failure_kinds`: each failed call as its error kind and one line (the raised type and the
    first line of its message, the deadline, the refused value), counted by kind, whatever numbers
    the messages hold, with the first one's message; the held-out log shows a line per kind."""
    from asyncrl.rl.observe.report import heldout_failures_lines
    from asyncrl.rl.tasks.scoring import failure_kinds

    def refuse(n):
        if n < 0:
            raise KeyError(n)
        raise ValueError(f"the prompt has {n} tokens\nand more")

    async def sleeps():
        await asyncio.sleep(5)

    calls = UserCalls("kinds", 0.2, 1.0)
    outcomes = [await calls.call(refuse, n, what="agent") for n in (131, 149, -1)]
    outcomes += [await calls.call(sleeps, what="agent"), await calls.call(lambda: "x", what="agent", convert=float)]
    outcomes.append(await calls.call(lambda: 1.0, what="agent", convert=float))
    calls.close()
    kinds = failure_kinds(outcomes)
    assert kinds == {
        "raised ValueError: the prompt has 131 tokens": 2,
        "raised KeyError: -1": 1,
        "timeout agent ran past its 0.2 s deadline": 1,
        "bad_value agent() returned a bad value: ValueError: could not convert string to float: 'x'": 1,
    }
    assert heldout_failures_lines({f"sampled: {k}": v for k, v in list(kinds.items())[:1]}) == [
        "held-out sampled episodes failed, scored 0: 2 raised ValueError: the prompt has 131 tokens"
    ]


async def test_too_many_failures_stop_the_run_with_the_first_traceback():
    calls = UserCalls("scored", 5.0, max_failure_rate=0.5, min_calls=6)
    await runner(Scored(), calls).run(problems(1.0, "raise"), 2, GREEDY, Script(SCRIPT))
    calls.check()  # 2 of 4: too few calls to judge
    await runner(Scored(), calls).run(problems("raise"), 2, GREEDY, Script(SCRIPT))
    with pytest.raises(TaskFailureError) as err:
        calls.check()  # 4 of 6 failed
    message = str(err.value)
    assert "task scored" in message and "4 of 6" in message and "--task.max_failure_rate 0.5" in message
    assert "ValueError: no reward for '<answer>41</answer>'" in message and "Traceback" in message
    # the traceback starts at the user's frame: none of the frames that ran the call
    assert "scoring.py" not in message and message.split("Traceback (most recent call last):\n")[1].startswith(
        f'  File "{__file__}"'
    ), message
    assert type(err.value) is TaskFailureError  # what the driver catches (test_remote_errors.py: across processes)


async def test_hung_threads_shrink_the_pool_and_calls_that_find_none_count_as_timeouts():
    """A hang is not fatal by itself (a slow call now and then costs only its own score); while
    every place is held, a call waits, then counts as a timeout, and the failure budget decides."""
    calls = UserCalls("scored", 0.2, 0.5, min_calls=4, workers=3)
    try:
        samples = await runner(Scored(), calls).run(problems("hang", "hang", "hang"), 1, GREEDY, Script(SCRIPT))
        assert [s.error for g in samples for s in g] == ["timeout"] * 3 and calls.hung == 3
        late = await calls.call(print, "x", what="score")  # no place left: it waits, then times out
        assert late.error == "timeout" and "no free worker" in late.detail
        with pytest.raises(TaskFailureError, match=r"task scored: 4 of 4 score/step calls failed"):
            calls.check()
    finally:
        Scored.release.set()
    assert await asyncio.to_thread(lambda: _wait(lambda: calls.hung == 0, 5.0))
    assert (await calls.call(len, "abc", what="score")).value == 3  # the workers came back
    calls.close()


async def test_a_deadline_starts_when_the_call_runs_not_while_it_waits():
    calls = UserCalls("slow", 0.5, 1.0, workers=2)
    outcomes = await asyncio.gather(*(calls.call(time.sleep, 0.3, what="score") for _ in range(6)))
    assert [o.error for o in outcomes] == [""] * 6  # 6 calls of 0.3 s on 2 workers: 0.9 s, none late
    calls.close()
    with pytest.raises(TaskFailureError, match="after close"):
        await calls.call(len, "", what="score")


async def test_a_seed_makes_the_episodes_repeat(policy):
    from asyncrl.rl.sampler.hf import HFBackend

    model, tok, fmt = policy
    backend = HFBackend(model, tokenizer=tok, seed=0)
    try:
        env = _NeedleEnv(await _needle(backend, fmt))
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, stop_token_ids=list(fmt.stop_token_ids))
        run = EpisodeRunner(env, fmt, UserCalls("needle", 5.0, 1.0))
        a = await run.run(NEEDLE_PROBLEMS, 3, params, backend.generate)
        b = await run.run(NEEDLE_PROBLEMS, 3, params, backend.generate)
        c = await run.run(NEEDLE_PROBLEMS, 3, msgspec.structs.replace(params, seed=6), backend.generate)
        assert a == b and a != c
    finally:
        backend.close()


# --- the HF backend end to end ----------------------------------------------------------------------

NEEDLE_PROBLEMS = ["12 3 4 -> 9", "5 6 7 -> 11"]


class _NeedleEnv(Environment):
    """Three turns whatever the model writes; a turn may end at a stop string the random model
    does write (found by a greedy run)."""

    name = "needle"
    max_turns = 3

    def __init__(self, stop: str):
        super().__init__()
        self.stop = [stop]
        self.texts: list[str] = []

    def prompt(self, problem):
        return problem

    def step(self, episode, completion):
        self.texts.append(completion)
        if episode.model_turns == 3:
            return Reply(
                done=True, reward=float(len(completion)), metrics={"stopped": completion.endswith(self.stop[0])}
            )
        return Reply(f"<result>{episode.model_turns}</result>")


async def _needle(backend, fmt) -> str:
    """Two characters from the middle of a greedy completion of the first problem."""
    [[free]] = await backend.generate(
        [fmt.render_ids(Prompt([Message("user", NEEDLE_PROBLEMS[0])], compact=NEEDLE_PROBLEMS[0]))],
        1,
        SamplingParams(max_new_tokens=16, temperature=0.0),
    )
    needle = free.text[6:8]
    assert needle.strip() and len(needle) == 2, free.text
    return needle


async def test_an_environment_with_stop_strings_on_the_hf_backend(policy):
    from asyncrl.rl.sampler.hf import HFBackend

    model, tok, fmt = policy
    backend = HFBackend(model, tokenizer=tok, seed=0)
    try:
        env = _NeedleEnv(await _needle(backend, fmt))
        # Greedy: the first problem's first turn is the run the needle came from, so it ends there.
        params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=list(fmt.stop_token_ids))
        groups = await EpisodeRunner(env, fmt, UserCalls("needle", 5.0, 1.0)).run(
            NEEDLE_PROBLEMS, 2, params, backend.generate
        )
    finally:
        backend.close()
    assert any(t.endswith(env.stop[0]) for t in env.texts)  # some turns did end at the string
    for problem, group in zip(NEEDLE_PROBLEMS, groups):
        prompt = fmt.render_ids(Prompt([Message("user", problem)], compact=problem))
        for s in group:
            assert s.metrics["turns"] == 3.0 and s.error == ""
            mask = torch.tensor(s.action_mask, dtype=torch.bool)
            replies = tok.decode([t for t, m in zip(s.token_ids, s.action_mask) if not m])
            assert replies == "<result>1</result><result>2</result>"
            # Each model token's behaviour log-prob is the model's over the full context.
            ref = recomputed(model, prompt, s.token_ids, 1.0)
            assert torch.allclose(torch.tensor(s.logprobs)[mask], ref[mask], atol=1e-4, rtol=0)
            assert (torch.tensor(s.logprobs)[~mask] == 0).all()


# --- reply_ids: chat templates --------------------------------------------------------------------

QWEN_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture
def chat_fmt():
    tok = build_tokenizer()
    tok.chat_template = QWEN_LIKE
    return PromptFormat("chat", tok, [tok.eos_token_id], 64)


@pytest.mark.parametrize("ended_on_token", [True, False])
def test_chat_replies_continue_the_conversation_as_the_template_renders_it(chat_fmt, ended_on_token):
    tok = chat_fmt.tokenizer
    prompt = Prompt([Message("system", "be brief"), Message("user", "2+3?")])
    context = chat_fmt.render_ids(prompt)
    turns: list[Message] = []
    for turn, reply in (("<calc>2+3</calc>", Reply("5")), ("then <calc>5*2</calc>", Reply("10", role="user"))):
        context += ids(turn) + ([tok.eos_token_id] if ended_on_token else [])  # a stop token, or a stop string
        turns.append(Message("assistant", turn))
        context += chat_fmt.reply_ids(prompt, turns, reply, ended_on_token)
        turns.append(Message(reply.role, reply.text))
    whole = [{"role": m.role, "content": m.content} for m in [*prompt.messages, *turns]]
    assert tok.decode(context) == tok.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
    delta = chat_fmt.reply_ids(prompt, turns[:1], Reply("5"), ended_on_token)
    assert tok.decode(delta) == ("" if ended_on_token else "<|im_end|>") + (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_compact_replies_are_the_text_as_is():
    prompt = Prompt([Message("user", "x")], compact="x")
    turns = [Message("assistant", "a")]
    assert FMT.reply_ids(prompt, turns, Reply("<result>5</result>"), True) == ids("<result>5</result>")
    assert FMT.reply_ids(prompt, turns, Reply(""), False) == []


# --- tools ------------------------------------------------------------------------------------------


def test_tool_calls_are_parsed_from_the_last_complete_call():
    assert parse_tool_call("a <calc>1+2</calc> b <calc>3*4</calc>", ["calc"]) == (CALC, "3*4")
    assert parse_tool_call("<calc>1</calc> <calc>2", ["calc"]) == (CALC, "1")  # the last is not complete
    assert parse_tool_call("<calc><calc>5</calc>", ["calc"]) == (CALC, "5")
    assert parse_tool_call("<search>q</search> <calc>1</calc>", ["calc", "search"]) == (CALC, "1")
    assert parse_tool_call("no call </calc>", ["calc"]) is None and parse_tool_call(None, ["calc"]) is None
    start = time.process_time()  # this process's CPU seconds: what the work costs, whatever else runs
    assert parse_tool_call("<calc>" * 200_000 + "</calc" * 100_000, ["calc"]) is None
    assert time.process_time() - start < 0.5
    with pytest.raises(ValueError, match="tool name"):
        parse_tool_call("x", ["a>b"])


def test_the_calculator_is_exact_and_never_evaluates_python():
    assert calculator("3 * (4 + 5)") == "27" and calculator("7 / 3") == "7/3" and calculator("2 - 5") == "-3"
    assert calculator("1 / 0").startswith("error: division by zero")
    assert calculator("__import__('os')").startswith("error: unexpected character")
    assert calculator("2 ** 99999").startswith("error:") and calculator("").startswith("error:")
    assert tool_result(calculator("6*7")) == "<result>42</result>" and tool_stops(["calc"]) == ["</calc>"]


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


async def test_episodes_jsonl_shows_an_episodes_tokens_by_mask(tmp_path):
    """RUN_DIR/episodes.jsonl (rl/observe/episodes_log.py): an episode the runner made, as the driver
    records it, reads back as the model's turns (mask 1, their stop tokens shown) and the
    environment's replies (mask 0), with the counts metrics.jsonl's tokens and completion_tokens sum."""
    import json

    from asyncrl.rl.observe.episodes_log import EpisodeLog
    from asyncrl.rl.rollout import RolloutGroup

    [[a]] = await runner(CalcEnv()).run([P1], 1, GREEDY, Script(SCRIPT))
    group = RolloutGroup(
        prompt_id=0,
        prompt_ids=ids("2+3="),
        completion_ids=[a.token_ids],
        behaviour_logprobs=[a.logprobs],
        rewards=[a.reward],
        version=3,
        sampler="sampler0",
        uid="sampler0/1/7",
        action_mask=[a.action_mask],
        correct=[a.correct],
    )
    log = EpisodeLog(str(tmp_path), "", print)
    log._tokenizer = TOK  # as load() leaves it for the run's policy
    log.write(5, [group])
    [record] = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert [(p["mask"], p["text"]) for p in record["pieces"]] == [
        (1, "<calc>2+3</calc>"),
        (0, "<result>5</result>"),
        (1, "so <calc>5*2</calc>"),
        (0, "<result>10</result>"),
        (1, "<answer>5</answer><|im_end|>"),
    ]
    assert record["tokens"] == sum(a.action_mask) and record["completion_tokens"] == len(a.token_ids)
    assert sum(p["tokens"] for p in record["pieces"]) == len(a.token_ids)
    assert record | {"pieces": None} == {
        "step": 5,
        "episode": 0,
        "group": "sampler0/1/7",
        "sampler": "sampler0",
        "version": 3,
        "reward": 1.0,
        "correct": True,
        "prompt": "2+3=",
        "pieces": None,
        "tokens": record["tokens"],
        "completion_tokens": len(a.token_ids),
    }


def test_asyncrl_show_prints_a_recorded_episode_by_mask(tmp_path, capsys):
    import json

    from asyncrl.cli import main

    pieces = [
        {"mask": 1, "text": " 10<|im_end|>", "tokens": 4},
        {"mask": 0, "text": " higher:", "tokens": 8},
        {"mask": 1, "text": " 15<|im_end|>", "tokens": 4},
    ]
    record = {
        "step": 7,
        "group": "sampler0/1/3",
        "sampler": "sampler0",
        "version": 6,
        "reward": 0.9,
        "correct": True,
        "prompt": "Guess my number (1-20):",
        "completion_tokens": 16,
        "tokens": 8,
        "pieces": pieces,
    }
    (tmp_path / "episodes.jsonl").write_text(json.dumps(record) + "\n" + '{"step": 8, "pie')  # cut short: skipped
    assert main(["show", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "step 7: group sampler0/1/3 from sampler0 (weights v6), reward 0.900, correct; 8 of its 16 tokens in the loss",
        '  prompt  "Guess my number (1-20):"',
        '  model   " 10<|im_end|>"  (4 tokens)',
        '  env     " higher:"  (8 tokens)',
        '  model   " 15<|im_end|>"  (4 tokens)',
    ]
    assert main(["show", str(tmp_path), "--step", "3"]) == 1
    assert capsys.readouterr().err.strip().endswith("no episode of step 3; episodes.jsonl has steps 7 to 7")
    assert main(["show", str(tmp_path / "nope")]) == 2


def test_more_episodes_a_step_with_their_token_ids_are_kept_and_shown_when_asked(tmp_path, capsys):
    """For debugging token-exactness: ``--run.episodes 3 --run.episode_ids true`` keeps the first 3
    completions of a step (across its groups, in the order trained) with their prompt and
    completion ids, masks and sampling log-probs; ``asyncrl show --episode K --ids`` prints them.
    Seen: one episode a step, text only. Without ids kept, ``--ids`` says how to keep them."""
    import json

    from asyncrl.cli import main
    from asyncrl.rl.config.observe import ObserveConfig
    from asyncrl.rl.observe.episodes_log import EpisodeLog
    from asyncrl.rl.rollout import RolloutGroup

    def group(uid: str, texts: list[str]) -> RolloutGroup:
        rows = [ids(t) for t in texts]
        return RolloutGroup(
            prompt_id=0,
            prompt_ids=ids("2+3="),
            completion_ids=rows,
            behaviour_logprobs=[[-0.25 * (i + 1)] * len(r) for i, r in enumerate(rows)],
            rewards=[1.0] * len(rows),
            version=3,
            sampler="sampler0",
            uid=uid,
            action_mask=[[1] * len(r) for r in rows],
        )

    batch = [group("sampler0/1/1", ["ab", "cd"]), group("sampler0/1/2", ["xy", "zz"])]
    log = EpisodeLog(str(tmp_path), "", print, episodes=3, ids=True)
    log._tokenizer = TOK  # as load() leaves it for the run's policy
    log.write(5, batch)
    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert [(r["episode"], r["group"], r["pieces"][0]["text"]) for r in records] == [
        (0, "sampler0/1/1", "ab"),
        (1, "sampler0/1/1", "cd"),
        (2, "sampler0/1/2", "xy"),
    ]
    last = records[2]
    assert (last["prompt_ids"], last["completion_ids"], last["mask"]) == (ids("2+3="), ids("xy"), [1, 1])
    assert last["logprobs"] == [-0.25, -0.25]

    assert main(["show", str(tmp_path), "--step", "5", "--episode", "1", "--ids"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "step 5 episode 1 of 3: group sampler0/1/1 from sampler0 (weights v3), reward 1.000; 2 of its 2 tokens "
        "in the loss",
        '  prompt  "2+3="',
        f"          ids {ids('2+3=')}",
        '  model   "cd"  (2 tokens)',
        f"          ids {ids('cd')}",
        "          logprobs [-0.5000, -0.5000]",
    ]
    assert main(["show", str(tmp_path), "--step", "5", "--episode", "3"]) == 1
    assert capsys.readouterr().err.strip().endswith("step 5 kept episodes 0 to 2 (--run.episodes), not 3")

    plain = tmp_path / "plain"
    plain.mkdir()
    default = EpisodeLog(str(plain), "", print)  # the defaults: the first episode, no ids
    default._tokenizer = TOK
    default.write(5, batch)
    assert [json.loads(line)["episode"] for line in (plain / "episodes.jsonl").read_text().splitlines()] == [0]
    assert main(["show", str(plain), "--ids"]) == 1
    assert "kept no token ids (--run.episode_ids true keeps them)" in capsys.readouterr().err
    assert ObserveConfig().episodes == 1 and not ObserveConfig().episode_ids
    with pytest.raises(ValueError, match="episodes must be"):
        ObserveConfig(episodes=-1)


def test_the_run_s_decoder_reads_a_policy_s_tokenizer_json_and_decodes_as_its_tokenizer(tmp_path):
    """episodes.jsonl's decoder (`load_decoder`) is the policy's ``tokenizer.json`` read by the
    ``tokenizers`` library (the driver imports no transformers for it): every id sequence decodes
    to the text transformers' tokenizer gives, special tokens and bytes cut mid-character
    included."""
    import random

    from transformers import AutoTokenizer

    from asyncrl.rl.observe.episodes_log import _decode, load_decoder

    tok = build_tokenizer(tags=("<calc>", "</calc>"))
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    decoder = load_decoder(str(tmp_path))
    assert type(decoder).__module__.startswith("tokenizers")
    rng = random.Random(0)
    rows = [ids("<calc>2+3</calc> é ü 中文") + [0, 1, 2], list(range(len(hf)))]
    rows += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    for row in rows:
        assert _decode(decoder, row) == _decode(hf, row), row
