"""The held-out evaluation of a saved policy: the model's evaluation (`evaluate`) on the task's
held-out split, greedy then sampled, merged as the trainer merges them, with what generates: the
model itself (transformers, the trainer's batches) or an engine from the samplers' factory."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.rl.config import ConfigError
from asyncrl.rl.generation import Completion, SamplingParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from asyncrl.rl.model.evaluation import Evaluation
    from asyncrl.rl.model.policy import PromptFormat
    from asyncrl.rl.sampler.backend import SamplerBackend

BATCH_SIZE = 64
"""Sequences per ``generate`` call: the trainer's evaluation's (`TrainerActor.evaluate`)."""
VLLM_CHUNK = 512
"""Sequences handed to a vLLM engine at once (it batches them itself; a progress line after each)."""


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
    ``open_generator(kind, policy, device, seed)``: what generates (default `PolicyGenerator.open`)."""
    open_generator = open_generator or PolicyGenerator.open
    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: a loading bar would bury the progress line
    import torch

    from asyncrl.rl.model.evaluation import evaluate_with
    from asyncrl.rl.tasks.loading import load_task
    from asyncrl.rl.tasks.scoring import UserCalls

    started = time.monotonic()
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
        limit, positions = fmt.max_new_tokens_hint, _positions(policy)

        def solve(what: str, rows: int, **how: Any) -> Evaluation:
            generate = generator.generate(what, rows, log)
            return asyncio.run(
                evaluate_with(
                    generate, fmt, problems, task=task, max_new_tokens=limit, calls=calls, max_context=positions, **how
                )
            )

        try:
            greedy = solve("greedy", 1, greedy=True)
            heldout = {"greedy": greedy.solve_rate}
            errors, failures = dict(greedy.errors), {f"greedy: {k}": v for k, v in greedy.failures.items()}
            temperature = config.sampler.temperature
            if run.eval_samples:
                sampled = solve("sampled", run.eval_samples, greedy=False, n=run.eval_samples, temperature=temperature)
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
    auto is `choose_backend`'s: vLLM on a GPU where it is installed, else hf (on the CPU, hf: the
    trainer's numbers)."""
    from asyncrl.rl.sampler.errors import SamplerError
    from asyncrl.rl.sampler.factory import choose_backend

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


class PolicyGenerator:
    """The policy loaded, and its `Generate` for `evaluate`, reporting progress: ``model``
    (transformers' ``generate`` in the trainer's batches: `hf_generate`) or an engine that
    ``make_engine`` builds, ``(SamplerBackend, PromptFormat)``, on an event loop of its own on a
    thread (each `evaluate` runs its episodes on a loop of its own, and an engine such as vLLM's
    keeps one loop for its requests)."""

    def __init__(
        self,
        *,
        model: PreTrainedModel | None = None,
        fmt: PromptFormat | None = None,
        make_engine: Callable[[], tuple[SamplerBackend, PromptFormat]] | None = None,
    ):
        self.model = model
        self.backend: SamplerBackend | None = None
        if make_engine is None:
            if model is None or fmt is None:
                raise ValueError("PolicyGenerator: give a model and its format, or make_engine")
            self.fmt = fmt
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
    def open(cls, kind: str, policy: str, device: torch.device, seed: int) -> PolicyGenerator:
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

    async def _on_engine_loop(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        if self.backend is None:
            raise RuntimeError("PolicyGenerator: no engine (made with a model: it generates in this thread)")
        call = asyncio.run_coroutine_threadsafe(self.backend.generate(prompts, n, params), self.loop)
        return await asyncio.wrap_future(call)

    def __enter__(self) -> PolicyGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
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
