"""``asyncrl eval POLICY``: the held-out solve rates and task metrics of a saved policy, greedy and
sampled, as a run's own evaluation measures them.

POLICY is a Hugging Face checkpoint directory (``RUN_DIR/final``, ``RUN_DIR/best``), or a
checkpoint (``RUN_DIR/checkpoints/step-N``, whose policy is its ``model/``). Inside a run
directory the run's config.json gives the task and the evaluation's settings (its held-out split,
``eval_samples``, the sampling temperature); ``--config FILE`` and ``--section.key VALUE`` apply
on top, as on a run's command line (`grpo_main`'s parser, task type included). The policy is
prompted in its own format (`load_policy`: the prompt style the run saved beside it).

The evaluation is the run's: `asyncrl.rl.model.evaluation.evaluate` on the task's held-out split
(``Task.splits``), greedy then ``eval_samples`` completions a problem at the temperature, the
task's calls under the run's deadline and failure budget, merged as the trainer merges them
(`asyncrl.rl.trainer.heldout.HeldoutEvaluation`). On the CPU (or ``--engine hf``) the completions
come from transformers' ``generate`` in the trainer's batches, so a greedy solve rate and the
greedy episodes' task metrics are the numbers the run's own evaluation of that policy logged;
the sampled rate is a draw from ``--seed``. With ``--engine vllm`` (the default where a GPU and
vLLM are there) they come from a vLLM engine built by the samplers' factory (`make_backend`).

Every mistake (a path without a policy, a key, a value) is a one-line `ConfigError` (exit status 2)
before anything loads; the task's code failing past its budget is exit status 1.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.rl.config import ConfigError, parse_overrides, take_option
from asyncrl.rl.config.files import RUN_CONFIG
from asyncrl.rl.config.stored import load_run_config
from asyncrl.rl.config.task import DEFAULT_TASK
from asyncrl.rl.launch import default_config, take_config_files

ENGINES = ("auto", "hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
BATCH_SIZE = 64
"""Sequences per ``generate`` call: the trainer's evaluation's (`TrainerActor.evaluate`)."""
VLLM_CHUNK = 512
"""Sequences handed to a vLLM engine at once (it batches them itself; a progress line after each)."""

USAGE = "usage: asyncrl eval POLICY [--out FILE] [--engine E] [--device D] [--seed N] [--config FILE] [--section.key V]"
OPTIONS = [
    ("--out FILE", "Write the result as JSON to FILE (the rates, the task's metrics, the settings)."),
    (
        "--engine auto|hf|vllm",
        "What generates: hf (transformers' generate, as the run's own evaluation), vllm (a vLLM "
        "engine), auto (vLLM on a GPU where it is installed, else hf).",
    ),
    ("--device auto|cpu|cuda", "Where the policy runs (auto: a GPU when there is one)."),
    ("--seed N", "Seed of the sampled completions (default 0)."),
    (
        "--config FILE",
        "Keys from a config file (TOML, YAML, a run's config.json), as for a run; flags win over it.",
    ),
    (
        "--section.key VALUE",
        "Any key of a run (asyncrl launch examples/grpo.py --help lists them); the evaluation reads "
        "--task.* and the task's own section, --run.n_heldout, --run.data_seed, --run.eval_samples "
        "(0: greedy only) and --sampler.temperature. Defaults: the run's config.json when POLICY is "
        "inside a run directory, else a run's defaults.",
    ),
]


def main(argv: list[str], log: Callable[[str], None] | None = None) -> int:
    """``asyncrl eval`` on ``argv`` (what follows ``eval``): the result on stdout (and in
    ``--out``), progress lines given to ``log`` (default: stderr); returns the exit status. A
    `ConfigError` (exit status 2) propagates to the caller, which prints its line."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    out, argv = take_option(argv, "--out", "FILE")
    engine, argv = _choice(argv, "--engine", ENGINES)
    device, argv = _choice(argv, "--device", DEVICES)
    seed_text, argv = take_option(argv, "--seed", "N")
    try:
        seed = int(seed_text or 0)
    except ValueError:
        raise ConfigError(f"--seed {seed_text}: expected an integer, e.g. --seed 0") from None
    files, argv = take_config_files(argv)
    given, argv = _take_policy(argv)
    if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise ConfigError(f"--out {out}: no such directory {os.path.dirname(os.path.abspath(out))}")
    policy, run_dir = find_policy(given)
    config = eval_config(argv, run_dir, files)
    from asyncrl.rl.tasks.scoring import TaskFailureError

    progress = log or ProgressLine()
    try:
        result = evaluate_policy(policy, config, engine=engine, device=device, seed=seed, log=progress)
    except TaskFailureError as exc:  # the task's code failed past its budget, as it stops a run
        print(f"asyncrl eval: {exc}", file=sys.stderr)
        return 1
    finally:
        if isinstance(progress, ProgressLine):
            progress.end()
    result["run_dir"] = run_dir
    if out:
        try:
            with open(out, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
        except OSError as exc:
            print(f"asyncrl eval: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
            print(json.dumps(result, indent=2))  # the numbers are not lost
            return 1
    print(result_text(result) + (f"\nasyncrl eval: wrote {out}" if out else ""))
    return 0


def help_text() -> str:
    from asyncrl.rl.config.helptext import options_text

    doc = (
        "The held-out solve rates (greedy, and sampled) and the task's metrics of a saved policy: "
        "POLICY is RUN_DIR/final, RUN_DIR/best, a checkpoint (RUN_DIR/checkpoints/step-N) or any "
        "Hugging Face checkpoint directory. Inside a run directory the run's own task and settings "
        "apply, and on hf the greedy numbers are those the run's evaluation logged for that policy. "
        "Exit status: 0 done, 1 the task's code failed past its budget, 2 a usage error (one line)."
    )
    return f"{USAGE}\n\n{doc}\n\n{options_text(OPTIONS)}"


def _take_policy(argv: list[str]) -> tuple[str, list[str]]:
    """The first word of ``argv`` that is neither a flag nor a flag's value (``--key value``,
    ``--key=value``), and the rest."""
    i = 0
    while i < len(argv):
        if not argv[i].startswith("-"):
            return argv[i], argv[:i] + argv[i + 1 :]
        i += 1 if "=" in argv[i] else 2
    raise ConfigError(f"no POLICY given: {USAGE.removeprefix('usage: ')}")


def _choice(argv: list[str], flag: str, choices: Sequence[str]) -> tuple[str, list[str]]:
    value, argv = take_option(argv, flag, "|".join(choices))
    if value and value not in choices:
        raise ConfigError(f"{flag} {value}: expected one of {', '.join(choices)}")
    return value or choices[0], argv


# --- the policy and its run -----------------------------------------------------------------------


def find_policy(path: str) -> tuple[str, str]:
    """(the policy's checkpoint directory, the run directory it is in, "" if none) of ``path``;
    a path that holds no policy is a one-line `ConfigError` saying what would."""
    what = "give RUN_DIR/final, RUN_DIR/best, a checkpoint (RUN_DIR/checkpoints/step-N) or a Hugging Face checkpoint"
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such directory; {what}")
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is a file, not a directory; {what}")
    if _run_config(path) is not None:
        found = [os.path.join(path, name) for name in ("final", "best") if os.path.isdir(os.path.join(path, name))]
        found = found or [f"{path}/checkpoints/step-N"]
        raise ConfigError(f"{path} is a run directory, not a policy: evaluate {' or '.join(found)}")
    policy = path
    if not os.path.isfile(os.path.join(path, "config.json")):
        model = os.path.join(path, "model")
        if os.path.isfile(os.path.join(model, "config.json")):
            policy = model
        elif os.path.isfile(os.path.join(model, "adapter_config.json")):
            raise ConfigError(
                f"{path} holds LoRA adapters only (a checkpoint of a LoRA run): evaluate the run's final "
                "or best policy, saved merged"
            )
        else:
            raise ConfigError(f"{path} holds no policy (no config.json, nor model/config.json); {what}")
    return os.path.abspath(policy), _run_dir_of(os.path.abspath(policy))


def _run_dir_of(policy: str) -> str:
    """The run directory ``policy`` is in (final/, best/, checkpoints/step-N/model/), or ""."""
    parent = os.path.dirname(policy)
    for _ in range(3):
        if _run_config(parent) is not None:
            return parent
        parent = os.path.dirname(parent)
    return ""


def _run_config(path: str) -> dict | None:
    """``path/config.json`` when it is a run's (a table with a run section), else None."""
    try:
        with open(os.path.join(path, RUN_CONFIG)) as f:
            values = json.load(f)
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) and isinstance(values.get("run"), dict) else None


def eval_config(argv: list[str], run_dir: str, files: Sequence[Any] = ()) -> Any:
    """The run config whose task and evaluation settings apply: the run's config.json (when the
    policy is in a run directory) or the defaults of the task the line names, then ``files`` and
    the flags ``argv``."""
    default = default_config(argv, run_dir, DEFAULT_TASK, files)
    if run_dir:
        default = load_run_config(default, run_dir)
    return parse_overrides(default, argv, files)


# --- the evaluation -------------------------------------------------------------------------------


def evaluate_policy(
    policy: str,
    config: Any,
    *,
    engine: str = "auto",
    device: str = "auto",
    seed: int = 0,
    log: Callable[[str], None] = print,
    open_generator: Callable[[str, str, Any, int], Any] | None = None,
) -> dict[str, Any]:
    """The held-out evaluation of the policy at ``policy`` on ``config``'s task and settings:
    ``heldout`` (``greedy``, ``sampled``), ``heldout_task`` (the task's metrics of the greedy
    episodes and the failed calls, keyed as in metrics.jsonl), ``failures`` (an agent's failed
    episodes by kind), and what was run (engine, device, problems, samples, temperature, seed).
    ``open_generator(kind, policy, device, seed)``: what generates (default `_Generator.open`)."""
    open_generator = open_generator or _Generator.open
    import torch

    from asyncrl.rl.model.evaluation import evaluate
    from asyncrl.rl.tasks.loading import load_task
    from asyncrl.rl.tasks.scoring import UserCalls

    started = time.monotonic()
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bar would bury the progress line
    where = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else device.replace("auto", "cpu"))
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no GPU here; use --device cpu (or auto)")
    spec, data, run = config.task_spec(), config.run.data, config.run
    task = load_task(spec)
    problems = list(task.splits(data.data_seed, 1, data.n_heldout).heldout)
    kind = _engine(engine, where)
    log(f"asyncrl eval: {policy}: task {task.task_name()}, {len(problems)} held-out problems; {kind} on {where}")
    torch.manual_seed(seed)
    with open_generator(kind, policy, where, seed) as generator:
        fmt = generator.fmt
        calls = UserCalls(task.task_name(), spec.score_timeout_s, spec.max_failure_rate, stop_early=True)
        common = dict(
            task=task,
            max_new_tokens=fmt.max_new_tokens_hint,
            batch_size=BATCH_SIZE,
            calls=calls,
            max_context=_positions(policy),
        )
        try:
            greedy = evaluate(
                generator.model,
                fmt.tokenizer,
                fmt,
                problems,
                greedy=True,
                generate=generator.generate("greedy", 1, log),
                **common,
            )
            heldout = {"greedy": greedy.solve_rate}
            errors, failures = dict(greedy.errors), {f"greedy: {k}": v for k, v in greedy.failures.items()}
            temperature = config.sampler.temperature
            if run.eval_samples:
                sampled = evaluate(
                    generator.model,
                    fmt.tokenizer,
                    fmt,
                    problems,
                    greedy=False,
                    n=run.eval_samples,
                    temperature=temperature,
                    generate=generator.generate("sampled", run.eval_samples, log),
                    **common,
                )
                heldout["sampled"] = sampled.solve_rate
                errors = {k: errors.get(k, 0) + sampled.errors.get(k, 0) for k in {*errors, *sampled.errors}}
                failures |= {f"sampled: {k}": v for k, v in sampled.failures.items()}
        finally:
            calls.close()
    extra = {f"heldout/task/{k}": v for k, v in greedy.metrics.items()}
    extra |= {f"heldout/task_errors/{k}": float(v) for k, v in sorted(errors.items())}
    return {
        "policy": policy,
        "task": task.task_name(),
        "heldout": heldout,
        "heldout_task": extra,
        "failures": failures,
        "heldout_problems": len(problems),
        "data_seed": data.data_seed,
        "eval_samples": run.eval_samples,
        "temperature": temperature,
        "engine": kind,
        "device": str(where),
        "seed": seed,
        "seconds": round(time.monotonic() - started, 3),
    }


def result_text(result: dict[str, Any]) -> str:
    """The result as the run's summary shows its evaluations."""
    rates = ", ".join(f"{rate:.3f} {kind}" for kind, rate in result["heldout"].items())
    lines = [f"held-out solve rate ({result['heldout_problems']} problems): {rates}"]
    metrics = [f"{k.removeprefix('heldout/task/')} {v:.3g}" for k, v in result["heldout_task"].items() if "/task/" in k]
    if metrics:
        lines.append(f"task metrics (greedy): {', '.join(metrics)}")
    errors = [f"{int(v)} {k.rsplit('/', 1)[1]}" for k, v in result["heldout_task"].items() if "task_errors" in k]
    if errors:
        lines.append(f"failed score/step calls, scored 0: {', '.join(errors)}")
    for kind, count in result["failures"].items():
        lines.append(f"failed episodes, {count}x {kind}")
    return "\n".join(lines)


def _engine(engine: str, device: Any) -> str:
    """hf or vllm: ``engine`` as asked (vllm where it cannot run is a one-line error naming why);
    auto is vLLM on a GPU where it is installed, else hf (on the CPU, hf: the trainer's numbers)."""
    from asyncrl.rl.sampler.backend import SamplerError
    from asyncrl.rl.sampler.factory import choose_backend

    if engine == "hf" or (engine == "auto" and device.type != "cuda"):
        return "hf"
    try:
        return choose_backend(engine, device)
    except SamplerError as exc:
        raise ConfigError(f"--engine {engine}: {exc}") from None


def _positions(policy: str) -> int:
    """The policy's positions (``max_position_embeddings`` of its config.json; 0: unknown), the
    context an episode may fill, as the trainer's evaluation reads it off its model."""
    try:
        with open(os.path.join(policy, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


class _Generator:
    """The policy loaded, and its `Generate` for `evaluate`, reporting progress: ``model``
    (transformers' ``generate`` in the trainer's batches: `hf_generate`) or an engine that
    ``make_engine`` builds, ``(SamplerBackend, PromptFormat)``, on an event loop of its own on a
    thread (each `evaluate` runs its episodes on a loop of its own, and an engine such as vLLM's
    keeps one loop for its requests)."""

    def __init__(self, *, model: Any = None, fmt: Any = None, make_engine: Callable[[], Any] | None = None):
        self.model, self.fmt, self.backend = model, fmt, None
        if make_engine is None:
            return
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="asyncrl-eval-engine", daemon=True)
        self.thread.start()
        try:
            self.backend, self.fmt = asyncio.run_coroutine_threadsafe(_call(make_engine), self.loop).result()
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def open(cls, kind: str, policy: str, device: Any, seed: int) -> _Generator:
        """hf: the model, loaded here; vllm: an engine from the samplers' factory."""
        if kind == "hf":
            import torch

            from asyncrl.rl.model.policy import load_policy

            model, _, fmt = load_policy(policy, device, torch.float32)
            return cls(model=model, fmt=fmt)
        from asyncrl.rl.sampler.factory import make_backend

        return cls(make_engine=lambda: make_backend(kind, policy, device=device, seed=seed))

    def generate(self, what: str, n: int, log: Callable[[str], None]) -> Any:
        """A `Generate` that hands its prompts on in chunks of whole batches of rows (so the
        batches are those of one call: the same padding, the same numbers) and logs each."""
        from asyncrl.rl.model.evaluation import hf_generate

        if self.model is not None:
            inner, rows = hf_generate(self.model, self.fmt.tokenizer, self.fmt, BATCH_SIZE), BATCH_SIZE
        else:
            inner, rows = self._on_engine_loop, VLLM_CHUNK
        chunk = rows // math.gcd(rows, n)  # prompts whose n rows fill whole batches

        async def generate(prompts, k, params):
            done = []
            for i in range(0, len(prompts), chunk):
                done += await inner(prompts[i : i + chunk], k, params)
                log(f"asyncrl eval: {what}: {min(i + chunk, len(prompts))}/{len(prompts)} prompts")
            return done

        return generate

    async def _on_engine_loop(self, prompts, n, params):
        call = asyncio.run_coroutine_threadsafe(self.backend.generate(prompts, n, params), self.loop)
        return await asyncio.wrap_future(call)

    def __enter__(self) -> _Generator:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.backend is not None:
            try:
                asyncio.run_coroutine_threadsafe(_call(self.backend.close), self.loop).result()
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _call(fn: Callable[[], Any]) -> Any:
    return fn()


class ProgressLine:
    """Progress on stderr: on a terminal one line rewritten in place, else a line each."""

    def __init__(self) -> None:
        self.tty, self.open = sys.stderr.isatty(), False

    def __call__(self, line: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r\033[K{line}")
            self.open = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        """End the line rewritten in place, so what follows starts on a line of its own."""
        if self.open:
            sys.stderr.write("\n")
            self.open = False
