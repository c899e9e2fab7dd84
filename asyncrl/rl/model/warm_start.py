"""The default policy, made locally: a small Qwen2-architecture model with a byte-level
tokenizer (one token per ASCII character), warm-started by supervised training on the task's
demonstrations (`Task.demonstration`: for Countdown, solver-written solutions; for an environment,
its model turns with the environment's replies between them) so that GRPO starts from a policy that
solves some held-out problems but far from all.

No hub and no internet: the tokenizer (``model/tokenizer.py``) is Qwen2's byte-level BPE pipeline
with the 256 byte symbols and no merges, built with ``tokenizers``; the model comes from a
``Qwen2Config``. The result is an ordinary HF checkpoint directory (safetensors weights, tokenizer
files, and a chat template that renders the very text the model was trained on: for Countdown a
user message ``"3 7 25 50 -> 178"`` becomes ``"3 7 25 50 -> 178:"``; for any other task each
message is rendered verbatim, a model turn followed by its eos, as `chat_template` says) plus
``asyncrl_model.json``, which records the prompt style the model was trained on ("compact":
`Prompt.compact`, or a ``str`` prompt as is). It is cached under a hash of everything that
determines it (the task's part is
`Task.fingerprint`), and written to a temporary directory that is renamed into place only when
complete: a crash mid-write leaves a ``.tmp-*`` directory that is never read, and is removed by a
later build once its writer is gone.

Any other local HF checkpoint directory can be named instead: ``model/policy.py``'s `load_policy`
then uses the checkpoint's own tokenizer and chat template around the task's prompt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import torch

from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.model.demonstrations import demonstration_rows
from asyncrl.rl.model.evaluation import check_stop, solve_rate
from asyncrl.rl.model.policy import MARKER_FILE, PromptFormat, stop_token_ids
from asyncrl.rl.model.reserve import fitted_warm_start
from asyncrl.rl.model.supervised import train_on_demonstrations
from asyncrl.rl.model.tokenizer import (
    AGENT_TAGS,
    TOKENIZER_SPEC,
    agent_chat_template,
    build_tokenizer,
    compact_chat_template,
)
from asyncrl.rl.tasks.agent import Agent
from asyncrl.rl.tasks.base import Environment, Task, TaskError
from asyncrl.rl.tasks.scoring import TaskFailureError, UserCalls
from asyncrl.runtime.files import write_atomic
from asyncrl.runtime.transport import pid_alive

_TRAIN_THREADS = 1
"""Intra-op threads of the warm start's training: fixed, so the weights do not depend on the machine."""

# Bump when the tokenizer, data or training code changes what a cached checkpoint would contain.
# (A bump changes every key, Countdown's included: its cached default model would be rebuilt.)
_FORMAT_VERSION = 1
_KEY_FIELDS = ("version", "model", "warm", "tokenizer", "chat_template", "turn_end", "tags", "trained_on")
"""The cache key's own fields; a task's fingerprint may not use these names."""

# --- the cached default ---------------------------------------------------------------------------


def cache_root(cache_dir: str | None = None) -> str:
    """``cache_dir``, else ``$ASYNCRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncrl`` (``~/.cache``)."""
    if cache_dir:
        return cache_dir
    if os.environ.get("ASYNCRL_CACHE_DIR"):
        return os.environ["ASYNCRL_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "asyncrl")


def as_task(task: Task | None) -> Task:
    """``task`` itself; for None, Countdown with its default options (the embedded default)."""
    if task is None:
        from asyncrl.rl.tasks.countdown import Countdown

        return Countdown()
    return task


def cache_key(model: ModelConfig, warm: WarmStartConfig, task: Task | None = None, trained_on: str = "cpu") -> str:
    """Hash of everything that determines the default checkpoint: the model, the warm start, the
    tokenizer and the task's `Task.fingerprint` (for Countdown, its options and a probe problem's
    prompt and reference, so a change to their formats invalidates the cache without a version
    bump; the key is the one Countdown had before tasks were public, so cached models are reused).
    ``trained_on``: the device it trains on, as `trained_on` names it; "cpu" adds nothing, so the
    keys of CPU warm starts are those of before GPUs could train them."""
    task = as_task(task)
    fingerprint = task.fingerprint()
    if not isinstance(fingerprint, dict) or any(not isinstance(k, str) or k in _KEY_FIELDS for k in fingerprint):
        raise TaskError(
            f"task {task.task_name()}: fingerprint() must return a dict with string keys other "
            f"than {', '.join(_KEY_FIELDS)}, not {fingerprint!r:.120}"
        )
    warm_fields = asdict(warm)
    del warm_fields["device"]  # what was asked ("auto"); where it trained is ``trained_on``
    spec = {
        "version": _FORMAT_VERSION,
        "model": asdict(model),
        "warm": warm_fields,
        "tokenizer": TOKENIZER_SPEC,
        **_task_format(task),
        **fingerprint,
        **({"trained_on": trained_on} if trained_on != "cpu" else {}),
    }
    try:
        text = json.dumps(spec, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TaskError(f"task {task.task_name()}: fingerprint() must hold JSON values only: {e}") from e
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _is_countdown(task: Task) -> bool:
    from asyncrl.rl.tasks.countdown import Countdown

    return type(task) is Countdown


def chat_template(task: Task) -> str:
    """The chat template saved with a model warm-started on ``task`` (and so with the run's
    ``final/`` and ``best/``, which copy its tokenizer): Countdown's own; for any other task one
    that renders the task's prompt and turns as they were trained (`compact_chat_template`)."""
    if _is_countdown(task):
        return str(TOKENIZER_SPEC["chat_template"])  # a str: the dict holds lists beside it
    if isinstance(task, Agent):
        return agent_chat_template()
    return compact_chat_template(list(task.stop) if isinstance(task, Environment) else [])


def _task_format(task: Task) -> dict[str, Any]:
    """The cache key's part for a task other than Countdown: its chat template and where its model
    turns end (eos after each, unless on a stop string; models cached before had it after the last
    turn only, and Countdown's template), so such a model is not reused. Countdown's key (and
    its rows and template) is unchanged."""
    if _is_countdown(task):
        return {}
    if isinstance(task, Agent):
        return {"chat_template": chat_template(task), "tags": AGENT_TAGS}
    return {"chat_template": chat_template(task), "turn_end": "eos unless on a stop string"}


def default_model(
    model: ModelConfig = ModelConfig(),
    warm: WarmStartConfig = WarmStartConfig(),
    task: Task | None = None,
    *,
    cache_dir: str | None = None,
    threads: int | None = None,
    log: Callable[[str], object] = print,
    stop: threading.Event | None = None,
    n_heldout: int | None = None,
    score_calls: tuple[float, float] = (10.0, 0.2),
    run_device: str = "cpu",
) -> str:
    """Path of the embedded policy's checkpoint directory for ``task`` (Countdown if None), built
    and warm-started on the task's demonstrations on first use.

    The training data: the compact prompt of each problem of ``task.splits(warm.data_seed,
    warm.n_examples, warm.heldout_reserve).train`` followed by its `Task.demonstration` (a problem
    without one is skipped; a task with none at all is a `TaskError`: the embedded model needs
    demonstrations, or give ``--model_path``). Labels cover the model's text only: an environment's
    replies between the model's turns are context, as in its episodes. After training, the greedy
    solve rate on the first ``warm.eval_problems`` held-out problems goes into the marker file.

    Cached at ``<cache_root>/models/<cache_key>``. Only a complete directory ever has that name: it
    is written under a temporary name and renamed, so a second call (even after a crash of the
    first) either finds a whole checkpoint or builds one afresh.

    The training itself always runs on one torch thread, so the weights cached under a key are the
    same on any machine (of one CPU kind) whatever its core count; see ``_build``. Or on this
    process's first CUDA device (``warm.device``; "auto" picks it where ``run_device``, the run's
    device plan, is "cuda"), cached under a key that names the GPU model.

    ``threads``: torch intra-op threads of the greedy evaluation after training (it changes no
    weights); None: the cores this process may run on (its CPU affinity), at most 4. Not a load
    reading: one taken just after a burst (pip) picked 1 thread on an idle machine. On cores that
    other busy processes share, pass 1: OpenMP threads waiting at each barrier for a descheduled
    sibling cost more than they bring (2 threads ran several times slower than 1 on 2 loaded cores:
    benchmarks/README.md, "Figures that were in the code").

    ``stop``: once set, the build stops within a training step (or a data / evaluation chunk) and
    raises `StoppedError`, leaving nothing in the cache. For a caller that runs this in a worker
    thread (``asyncio.to_thread``) and is cancelled: a thread cannot be killed, and asyncio's
    shutdown waits for it.

    ``n_heldout``: the run's held-out problems (``--run.n_heldout``); with it, the reserve of a
    task with few problems shrinks to it, and that of a task with ``--task.heldout_data`` is the
    file's rows (``model/reserve.py``), said in one line.

    ``score_calls``: the deadline (s) and failure budget (share) of the task's calls in the solve
    rate after training (``--task.score_timeout_s``, ``--task.max_failure_rate``).
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1 or None, not {threads}")
    task = as_task(task)
    warm, fitted = fitted_warm_start(warm, task, n_heldout)
    if fitted:
        log(f"[model] {fitted}")
    device = warm_start_device(warm.device, run_device)
    models_dir = os.path.join(cache_root(cache_dir), "models")
    key = cache_key(model, warm, task, trained_on(device))
    final = os.path.join(models_dir, key)
    if _is_complete(final):
        log(f"[model] cached default policy {final}")
        return final
    os.makedirs(models_dir, exist_ok=True)
    _remove_orphans(models_dir, key, log)
    tmp = tempfile.mkdtemp(dir=models_dir, prefix=f".tmp-{key}-{os.getpid()}-")
    try:
        _build(tmp, model, warm, task, threads, log, stop, score_calls, device)
        _publish(tmp, final, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    return final


def warm_start_device(asked: str, run_device: str) -> str:
    """Where a warm start trains, "cpu" or "cuda": ``asked`` (`WarmStartConfig.device`) with "auto"
    resolved against ``run_device`` (the run's device plan) and what this process sees."""
    if asked == "cpu" or (asked == "auto" and run_device != "cuda"):
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if asked == "auto":  # a plan on GPUs of other nodes: this process has none
        return "cpu"
    raise ConfigError(
        "--warm_start.device cuda, but this process sees no CUDA device (CUDA_VISIBLE_DEVICES or the "
        "driver may hide them); use --warm_start.device auto or cpu"
    )


def trained_on(device: str) -> str:
    """What a warm start's cache key names of its device: "cpu", or the GPU's model (two GPU models
    need not compute the same bits)."""
    return "cpu" if device == "cpu" else f"cuda:{torch.cuda.get_device_name(0)}"


def _is_complete(path: str) -> bool:
    # The marker is written last, and the directory renamed after it: its presence means complete.
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def _publish(tmp: str, final: str, log: Callable[[str], object]) -> None:
    """``tmp`` renamed to ``final`` unless another builder got there first. Not the replacing
    rename of a checkpoint (``runtime/files.py``'s `staged_dir`): the first complete build of a
    key wins and is never moved or replaced, because other processes may be loading from it."""
    if os.path.isdir(final) and not _is_complete(final):
        log(f"[model] replacing incomplete {final}")  # not ours (we rename whole dirs); never reuse it
        shutil.rmtree(final)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):  # not a concurrent builder winning the race: a real failure
            raise
        log(f"[model] another process built {final} first; using it")


def _remove_orphans(models_dir: str, key: str, log: Callable[[str], object]) -> None:
    """Temporary directories of crashed builders of ``key`` (their pid is gone)."""
    prefix = f".tmp-{key}-"
    for name in os.listdir(models_dir):
        pid = name[len(prefix) :].split("-")[0] if name.startswith(prefix) else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            log(f"[model] removing partial build {name}")
            shutil.rmtree(os.path.join(models_dir, name), ignore_errors=True)


def _build(
    out: str,
    model_cfg: ModelConfig,
    warm: WarmStartConfig,
    task: Task,
    threads: int | None,
    log: Callable[[str], object],
    stop: threading.Event | None = None,
    calls: tuple[float, float] = (10.0, 0.2),
    device: str = "cpu",
) -> None:
    tokenizer = build_tokenizer(AGENT_TAGS if isinstance(task, Agent) else ())
    tokenizer.chat_template = chat_template(task)
    check_stop(stop)
    train, heldout = task.splits(warm.data_seed, warm.n_examples, warm.heldout_reserve)
    check_stop(stop)
    ids, labels, lengths, longest_turn = demonstration_rows(tokenizer, task, train, model_cfg.max_positions, stop)
    # Training runs on one intra-op thread whatever ``threads`` says, so that the weights cached
    # under a key do not depend on the machine's core count (the key does not name it). With more
    # threads, torch splits elementwise kernels (SiLU) into per-thread chunks whose ends need not
    # fall on the vector width, and the tail is computed differently: on 3 threads one SiLU output
    # was 4e-9 off at the third step, and 48 of 50 tensors differed after 30 (2 threads happened to
    # agree with 1 bit for bit over all 400 steps, 4 over 30: sizes that split evenly). Cost, 2 cores, default
    # config: ~275 ms a step on one thread against ~150 ms on two when idle (400 steps: ~110 s
    # against ~60 s, once per cache key); under load two threads were slower (545 against 930 ms).
    # On a GPU the weights are initialised on the CPU as above, then moved: the same start on both.
    with _torch_threads(_TRAIN_THREADS):
        torch.manual_seed(warm.seed)
        model = new_model(model_cfg, tokenizer).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        where = "on one thread (the same weights on any machine)" if device == "cpu" else f"on {trained_on(device)}"
        log(
            f"[model] warm-starting {n_params / 1e6:.2f}M-parameter Qwen2 on {len(ids)} {task.task_name()} "
            f"problems, {warm.steps} steps of {warm.batch_size}, {where}"
        )
        start = time.monotonic()
        loss = train_on_demonstrations(model, ids, labels, lengths, warm, log, stop)
        wall_s = time.monotonic() - start
    with _torch_threads(threads or _usable_cores()):  # the evaluation changes no weights
        hint = longest_turn + 8  # slack: a sampled turn may be a little longer than any demonstrated one
        fmt = PromptFormat(
            "compact",
            tokenizer,
            stop_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer),
            hint,
        )
        greedy = (
            _checked_rate(model, tokenizer, fmt, heldout[: warm.eval_problems], task, stop, model_cfg, calls, log)
            if warm.eval_problems
            else None
        )
    # The solve rate goes to the marker file only: a GRPO run prints its own held-out number before
    # training (on its n_heldout problems), and two different "held-out" figures read as a conflict.
    log(f"[model] warm start done in {wall_s:.0f} s, final loss {loss:.3f}")
    check_stop(stop)
    _save(
        out,
        model,
        tokenizer,
        {
            "prompt_style": "compact",
            "max_new_tokens_hint": hint,
            "format_version": _FORMAT_VERSION,
            "parameters": n_params,
            "warm_start_wall_s": round(wall_s, 1),
            "final_loss": round(loss, 4),
            "heldout_greedy_solve_rate": greedy,
            "model": asdict(model_cfg),
            "warm": asdict(warm),
            "task": task.task_name(),
            "train_examples": len(ids),
            "fingerprint": task.fingerprint(),
            "trained_on": trained_on(device),
        },
    )
    if device != "cpu":  # the driver runs on: leave the GPU's memory to the run's actors
        del model
        torch.cuda.empty_cache()


def _checked_rate(
    model,
    tokenizer,
    fmt: PromptFormat,
    problems: Sequence[Any],
    task: Task,
    stop: threading.Event | None,
    model_cfg: ModelConfig,
    calls: tuple[float, float],
    log: Callable[[str], object],
) -> float | None:
    """The greedy solve rate of the warm-started model, the task's code under the run's deadline
    and failure budget (``calls``: seconds, share); None, said in one line, when that code fails
    past its budget: the run's held-out evaluation then stops the run with the whole error."""
    user_calls = UserCalls(task.task_name(), calls[0], calls[1], stop_early=True)
    try:
        return solve_rate(
            model, tokenizer, fmt, problems, task=task, stop=stop, calls=user_calls, max_context=model_cfg.max_positions
        )
    except TaskFailureError as exc:
        log(f"[model] no solve rate after the warm start: {str(exc).splitlines()[0]}")
        return None
    finally:
        user_calls.close()


def _save(out: str, model, tokenizer, marker: dict) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # last, and flushed to disk: its presence marks a whole checkpoint
    write_atomic(os.path.join(out, MARKER_FILE), json.dumps(marker, indent=2), fsync=True)


def new_model(cfg: ModelConfig, tokenizer):
    """A freshly initialised (torch's current seed) Qwen2 of ``cfg``'s shape for ``tokenizer``'s
    vocabulary: what a warm start trains; benchmarks and tests make untrained checkpoints with it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """``threads`` intra-op threads inside the block, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _usable_cores(most: int = 4) -> int:
    """The cores this process may run on (its CPU affinity, else the machine's), at most ``most``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(most, cores))
