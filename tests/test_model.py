"""The embedded default policy: its tokenizer, the on-disk cache (reuse, atomicity, crash leftovers),
plain-transformers loading offline, prompt formats (any task's prompt in each style), and
load_policy on other checkpoints. A tiny
model and a few warm-start steps keep the whole file to seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.generation import SamplingParams
from asyncrl.rl.model import evaluation, warm_start
from asyncrl.rl.model.demonstrations import demonstration_rows
from asyncrl.rl.model.evaluation import solve_rate
from asyncrl.rl.model.policy import (
    MARKER_FILE,
    PolicyLoadError,
    PromptFormat,
    PromptStyleError,
    load_policy,
    load_prompt_format,
)
from asyncrl.rl.model.tokenizer import build_tokenizer
from asyncrl.rl.model.warm_start import cache_key, default_model
from asyncrl.rl.tasks.base import Message, Prompt, Score, Splits, Task
from asyncrl.rl.tasks.countdown import (
    Countdown,
    CountdownProblem,
    format_prompt,
    format_prompt_compact,
    format_reference,
    generate,
)

TINY = ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64)
FEW = WarmStartConfig(steps=4, batch_size=8, warmup_steps=1, n_examples=64, heldout_reserve=16, eval_problems=4)
P = CountdownProblem(numbers=[3, 7, 25, 50], target=178, solution="(50 - 25) * 7 + 3")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    """One tiny default model, built once for the module."""
    return default_model(TINY, FEW, cache_dir=str(tmp_path_factory.mktemp("cache")), threads=1, log=lambda _: None)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_round_trips_every_character():
    tok = build_tokenizer()
    ascii_text = "\n\t\r" + "".join(chr(c) for c in range(32, 127))
    for text in (
        ascii_text,
        format_prompt(P),
        format_prompt_compact(P) + format_reference(P),
        "  two  spaces\n\nand unicode: é 中文 ✓",
        "<answer><answer>1 / 3</answer>",
    ):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # One token per ASCII character, one per answer tag: lengths the warm start budgets on.
    assert len(tok(ascii_text, add_special_tokens=False)["input_ids"]) == len(ascii_text)
    assert tok.convert_ids_to_tokens(tok("<answer>7</answer>", add_special_tokens=False)["input_ids"]) == [
        "<answer>",
        "7",
        "</answer>",
    ]
    assert tok.pad_token_id is not None and tok.eos_token_id is not None and tok.pad_token_id != tok.eos_token_id


def test_chat_template_renders_the_trained_prompt():
    """The user message is the numbers and the target; the template writes the compact prompt."""
    tok = build_tokenizer()
    compact = format_prompt_compact(P)  # "3 7 25 50 -> 178:"
    for content in (compact[:-1], compact, f"  {compact[:-1]}\n"):
        text = tok.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        assert text == compact
    # A conversation with the answer renders as the very sequence the warm start trains on.
    answer = [{"role": "user", "content": compact[:-1]}, {"role": "assistant", "content": format_reference(P)}]
    whole = tok.apply_chat_template(answer, tokenize=False)
    assert whole == compact + format_reference(P) + tok.eos_token
    assert (
        tok(whole, add_special_tokens=False)["input_ids"]
        == demonstration_rows(tok, Countdown(), [P], 64)[0][0].tolist()
    )
    with pytest.raises(Exception, match="trained on one prompt form"):
        tok.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}], tokenize=False
        )


# --- the cache ------------------------------------------------------------------------------------


def test_default_model_is_cached(built):
    root = os.path.dirname(os.path.dirname(built))
    lines: list[str] = []
    start = time.monotonic()
    again = default_model(TINY, FEW, cache_dir=root, log=lines.append)
    assert again == built and time.monotonic() - start < 1.0
    assert lines and "cached" in lines[0]
    assert os.path.basename(built) == cache_key(TINY, FEW, Countdown())
    assert cache_key(TINY, WarmStartConfig(steps=5), Countdown()) != cache_key(TINY, FEW, Countdown())
    assert not [n for n in os.listdir(os.path.dirname(built)) if n.startswith(".tmp-")]


def test_partial_builds_are_never_reused(tmp_path):
    models = tmp_path / "models"
    key = cache_key(TINY, FEW, Countdown())
    orphan = models / f".tmp-{key}-{dead_pid()}-abc"  # a builder that crashed mid-write
    orphan.mkdir(parents=True)
    (orphan / "config.json").write_text("{}")
    incomplete = models / key  # a final name without the marker: not written by us, never trusted
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{not json")
    path = default_model(TINY, FEW, cache_dir=str(tmp_path), threads=1, log=lambda _: None)
    assert path == str(incomplete) and os.path.isfile(os.path.join(path, MARKER_FILE))
    assert not orphan.exists()
    load_policy(path)


def test_crash_mid_build_leaves_nothing(tmp_path, monkeypatch):
    def crash(out, *args):
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(warm_start, "_build", crash)
    with pytest.raises(RuntimeError, match="mid-write"):
        default_model(TINY, FEW, cache_dir=str(tmp_path), log=lambda _: None)
    assert os.listdir(tmp_path / "models") == []


def test_saved_dir_loads_with_plain_transformers_offline(built, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(built, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(built, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size // model.config.num_attention_heads in (32, 64)
    assert model.config.vocab_size == len(tok)
    text = format_prompt_compact(P) + format_reference(P)
    assert (
        tok(text, add_special_tokens=False)["input_ids"]
        == build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    )
    with open(os.path.join(built, MARKER_FILE)) as f:
        marker = json.load(f)
    assert marker["prompt_style"] == "compact" and marker["max_new_tokens_hint"] > 0


def test_saved_chat_template_prompts_as_trained(built):
    """transformers' (and so vLLM's) chat prompt of a saved checkpoint is the driver's own prompt."""
    model, tok, fmt = load_policy(built)
    plain = AutoTokenizer.from_pretrained(built, local_files_only=True)
    for problem in [P, *generate(3, 5)]:
        messages = [{"role": "user", "content": " ".join(map(str, problem.numbers)) + f" -> {problem.target}"}]
        text = plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == fmt.render_text(Countdown().prompt(problem))
        ids = plain.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert list(ids) == fmt.render_ids(Countdown().prompt(problem))
    ids = torch.tensor([fmt.render_ids(Countdown().prompt(P))])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=tok.pad_token_id,
    )
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=fmt.stop_token_ids)
    (driver,) = evaluation._generate_rows(model, tok, fmt, [ids[0].tolist()], params)  # the run's own evaluation
    assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == driver.text


# --- prompts and loading --------------------------------------------------------------------------


def test_prompt_ids_end_where_the_completion_starts(built):
    _, tok, fmt = load_policy(built)
    assert fmt.style == "compact" and fmt.stop_token_ids == [tok.eos_token_id]
    for problem in [P, *generate(1, 20)]:
        prompt = fmt.render_ids(Countdown().prompt(problem))
        completion = tok(format_reference(problem), add_special_tokens=False)["input_ids"]
        whole = tok(format_prompt_compact(problem) + format_reference(problem), add_special_tokens=False)["input_ids"]
        assert prompt + completion == whole
        assert len(completion) + 1 <= fmt.max_new_tokens_hint  # the answer and its eos fit the hint


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def other_checkpoint(path, chat_template: bool) -> str:
    """A Qwen2 checkpoint that default_model did not build: no marker file, random weights, and a
    Qwen-style chat template (or none)."""
    tok = build_tokenizer()
    tok.chat_template = QWEN_CHAT_TEMPLATE if chat_template else None
    warm_start.new_model(TINY, tok).save_pretrained(path)
    tok.save_pretrained(path)
    if os.path.exists(os.path.join(path, "chat_template.jinja")) and not chat_template:
        os.remove(os.path.join(path, "chat_template.jinja"))
    return str(path)


def test_load_policy_accepts_another_checkpoint(tmp_path):
    model, tok, fmt = load_policy(other_checkpoint(tmp_path / "chat", chat_template=True))
    assert fmt.style == "chat" and tok.eos_token_id in fmt.stop_token_ids
    text = tok.decode(fmt.render_ids(Countdown().prompt(P)))
    assert text == f"<|im_start|>user\n{format_prompt(P)}<|im_end|>\n<|im_start|>assistant\n"
    rate = solve_rate(
        model, tok, fmt, generate(2, 3), greedy=False, n=2, max_new_tokens=4, batch_size=4, task=Countdown()
    )
    assert 0.0 <= rate <= 1.0

    _, tok, fmt = load_policy(other_checkpoint(tmp_path / "plain", chat_template=False))
    assert fmt.style == "plain" and tok.decode(fmt.render_ids(Countdown().prompt(P))) == format_prompt(P) + "\n"


def test_the_prompt_format_alone_is_load_policys(tmp_path, built):
    """What a vLLM sampler uses (no model loaded) must be what an HF sampler and the trainer use."""
    for path in (
        built,
        other_checkpoint(tmp_path / "chat", chat_template=True),
        other_checkpoint(tmp_path / "plain", chat_template=False),
    ):
        _, _, full = load_policy(path)
        _, alone = load_prompt_format(path)
        assert (alone.style, alone.stop_token_ids, alone.max_new_tokens_hint) == (
            full.style,
            full.stop_token_ids,
            full.max_new_tokens_hint,
        ), path
        assert alone.render_ids(Countdown().prompt(P)) == full.render_ids(Countdown().prompt(P))
    with pytest.raises(PolicyLoadError, match="no config.json"):
        load_prompt_format(str(tmp_path))


class Repeat(msgspec.Struct, frozen=True):
    word: str


class RepeatTask(Task):
    """A task of another kind than Countdown: two turns, no compact form, solved by the word."""

    name = "repeat"

    def splits(self, seed, n_train, n_heldout):
        return Splits([Repeat(f"w{i}") for i in range(n_train)], [Repeat(f"h{i}") for i in range(n_heldout)])

    def prompt(self, problem):
        return Prompt([Message("system", "Answer with the word."), Message("user", problem.word)])

    def score(self, problem, completion):
        return Score(float(completion.strip() == problem.word))


def test_a_policy_renders_any_tasks_prompt_in_its_style(tmp_path, built):
    task = RepeatTask()
    assert isinstance(task, Task)
    prompt = task.prompt(Repeat("seven"))
    model, tok, fmt = load_policy(other_checkpoint(tmp_path / "chat", chat_template=True))
    assert fmt.render_text(prompt) == (
        "<|im_start|>system\nAnswer with the word.<|im_end|>\n"
        "<|im_start|>user\nseven<|im_end|>\n<|im_start|>assistant\n"
    )
    rate = solve_rate(model, tok, fmt, task.splits(0, 0, 3).heldout, max_new_tokens=2, task=task)
    assert 0.0 <= rate <= 1.0
    _, _, fmt = load_policy(other_checkpoint(tmp_path / "plain", chat_template=False))
    assert fmt.render_text(prompt) == "Answer with the word.\nseven\n"
    _, fmt = load_prompt_format(built)  # the embedded model reads Countdown's compact form only
    assert fmt.render_text(Countdown().prompt(P)) == format_prompt_compact(P)
    with pytest.raises(PromptStyleError, match="no compact form"):
        fmt.render_text(prompt)


def test_batched_left_padded_generation_matches_one_at_a_time(built):
    model, tok, fmt = load_policy(built)
    problems = [
        CountdownProblem(numbers=[1, 2, 3], target=6, solution="1 + 2 + 3"),
        P,
        CountdownProblem(numbers=[99, 98, 97, 96], target=4, solution="99 - 98 + 97 - 96"),
    ]
    prompts = [fmt.render_ids(Countdown().prompt(p)) for p in problems]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=fmt.stop_token_ids)
    batched = evaluation._generate_rows(model, tok, fmt, prompts, params)
    alone = [evaluation._generate_rows(model, tok, fmt, [p], params)[0] for p in prompts]
    assert batched == alone


def test_load_policy_errors(tmp_path, built):
    with pytest.raises(PolicyLoadError, match="no config.json"):
        load_policy(str(tmp_path))
    bad = tmp_path / "bad"
    os.makedirs(bad)
    for name in os.listdir(built):
        with open(os.path.join(built, name), "rb") as src, open(bad / name, "wb") as dst:
            dst.write(src.read())
    (bad / MARKER_FILE).write_text(json.dumps({"prompt_style": "poetry"}))
    for load in (load_policy, load_prompt_format):
        (bad / MARKER_FILE).write_text(json.dumps({"prompt_style": "poetry"}))
        with pytest.raises(PolicyLoadError, match="poetry"):
            load(str(bad))
        (bad / MARKER_FILE).write_text("[1, 2")
        with pytest.raises(PolicyLoadError, match="unreadable"):
            load(str(bad))


@pytest.mark.parametrize(
    "bad",
    [
        lambda: ModelConfig(hidden_size=96, num_heads=2),  # head_dim 48
        lambda: ModelConfig(num_heads=4, num_kv_heads=3),
        lambda: ModelConfig(num_layers=0),
        lambda: WarmStartConfig(steps=0),
        lambda: WarmStartConfig(lr=0.0),
        lambda: WarmStartConfig(lr=float("nan")),
        lambda: WarmStartConfig(eval_problems=10, heldout_reserve=5),
        lambda: PromptFormat("poetry", None, [0], 8),
    ],
)
def test_bad_configs_raise_value_error(bad):
    with pytest.raises(ValueError):
        bad()


def test_solve_rate_arguments(built):
    model, tok, fmt = load_policy(built, dtype=torch.float32)
    with pytest.raises(ValueError, match="greedy"):
        solve_rate(model, tok, fmt, [P], n=2, task=Countdown())
    assert solve_rate(model, tok, fmt, [], task=Countdown()) == 0.0


# --- the held-out evaluation: the task's metrics, its code under the run's budget ----------------


class Scored(Countdown):
    """Countdown whose score does what the test says: metrics of its own, raising on some problems,
    or sleeping past the deadline."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def score(self, problem, completion):
        if self.how == "sleep":
            time.sleep(5)
        if self.how == "raise" and problem.target % 4 == 0:
            raise ZeroDivisionError("a bug in the reward")
        return Score(0.0, False, {"length": len(completion), "even_target": problem.target % 2 == 0})


def test_an_evaluation_in_parts_of_whole_batches_is_the_one_in_one_part(built):
    """The trainer's held-out evaluation solves its problems in parts (to say how far it has got):
    parts of whole batches make the very ``generate`` calls one part makes, in the same order, so
    a run's figures are what they were, the sampled ones too (the same RNG draws); each part is
    told with its positions and its tally, and the tallies add up to the answer."""
    model, tok, fmt = load_policy(built)
    problems = list(generate(0, 24))
    whole, parts = [], []
    for found, chunk in ((whole, 0), (parts, 8)):
        torch.manual_seed(7)
        for greedy, n in ((True, 1), (False, 2)):
            told = []
            result = evaluation.evaluate(
                model,
                tok,
                fmt,
                problems,
                task=Countdown(),
                greedy=greedy,
                n=n,
                batch_size=8,
                chunk=chunk // n,
                on_part=lambda positions, tally, told=told: told.append((positions, tally)),
            )
            found.append((result, told))
    assert [r for r, _ in parts] == [r for r, _ in whole]
    (greedy, told), (sampled, told_sampled) = parts
    assert [p for p, _ in told] == [range(0, 8), range(8, 16), range(16, 24)]
    assert [p for p, _ in told_sampled] == [range(i, i + 4) for i in range(0, 24, 4)]
    assert sum(t.episodes for _, t in told) == 24 and sum(t.episodes for _, t in told_sampled) == 48
    assert sum(t.correct for _, t in told) / 24 == greedy.solve_rate
    assert sum(t.metrics.get("has_answer", 0.0) for _, t in told) / 24 == greedy.metrics["has_answer"]


def test_an_evaluation_reports_the_tasks_metrics_and_its_failed_calls(built):
    from asyncrl.rl.tasks.scoring import UserCalls

    model, tok, fmt = load_policy(built)
    problems = list(generate(0, 12))
    # a budget no share of failures exceeds: which calls end first is the thread pool's timing (seen in CI:
    # 3 of the first 4 were raising ones, over 0.5), and the budget is the next test's
    calls = UserCalls("countdown", 5.0, 1.0, min_calls=4, stop_early=True)
    try:
        found = evaluation.evaluate(model, tok, fmt, problems, task=Scored("raise"), max_new_tokens=4, calls=calls)
    finally:
        calls.close()
    raising = sum(p.target % 4 == 0 for p in problems)
    assert 0 < raising <= 6 and found.errors == {"raised": raising}
    scored = [p for p in problems if p.target % 4]
    # means over every episode: a failed call's episode has no metric, and counts 0
    assert found.metrics["even_target"] == pytest.approx(sum(p.target % 2 == 0 for p in scored) / len(problems))
    assert 0 < found.metrics["length"] <= 4 * len(scored) / len(problems)


def test_a_reward_that_sleeps_stops_the_evaluation_at_its_budget_naming_it(built):
    """(Before: failures scored 0 without a word, and a reward sleeping 60 s held the evaluation of
    500 problems for over 14 minutes, one deadline per hung worker.)"""
    from asyncrl.rl.tasks.scoring import TaskFailureError, UserCalls

    model, tok, fmt = load_policy(built)
    calls = UserCalls("countdown", 0.3, 0.2, min_calls=4, workers=2, stop_early=True)
    started = time.monotonic()
    try:
        with pytest.raises(
            TaskFailureError,
            match=r"(?s)task countdown: 4 of 4 score/step calls failed \(100%, more "
            r"than --task.max_failure_rate 0.2\); the first failure:\nscore.*"
            r"ran past its 0.3 s deadline.*time.sleep\(5\)",
        ) as excinfo:
            evaluation.evaluate(
                model, tok, fmt, list(generate(0, 40)), task=Scored("sleep"), max_new_tokens=4, calls=calls
            )
        message = str(excinfo.value)
        assert message.split("it was at:\n")[1].startswith(f'  File "{__file__}"'), message  # the user's frame first
    finally:
        calls.close()
    assert time.monotonic() - started < 4.0  # not 40 problems x 0.3 s, nor a 5 s sleep per worker


def test_an_actor_on_the_cpu_keeps_the_cpu_and_torch_attention_settings():
    from asyncrl.rl.actor_device import actor_device

    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert actor_device("cpu") == torch.device("cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # switched off only for a GPU (test_gpu.py)
