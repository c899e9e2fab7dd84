"""The command line of ``asyncrl eval``: its own flags, POLICY, then a run's keys; the result on
stdout (and ``--out FILE``), a progress line on stderr."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence

from asyncrl.rl.config import ConfigError, take_option
from asyncrl.rl.launch import take_config_files
from asyncrl.rl.policy_eval.evaluation import evaluate_policy, result_text
from asyncrl.rl.policy_eval.policy import eval_config, find_policy

ENGINES = ("auto", "hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
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
    width = shutil.get_terminal_size().columns - 2  # as argparse and a script's --help
    return f"{USAGE}\n\n{textwrap.fill(doc, width)}\n\n{options_text(OPTIONS)}"


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
