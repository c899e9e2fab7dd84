"""Fully-async GRPO on Countdown: a small model learns to reach a target with + - * / and parentheses.

    asyncrl launch examples/grpo_countdown.py                       # embedded model, CPU or GPU
    asyncrl launch examples/grpo_countdown.py --run.mode sync       # the synchronous baseline
    asyncrl launch examples/grpo_countdown.py --model_path ~/ckpt/Qwen2.5-0.5B-Instruct --trainer.lr 1e-6
    asyncrl launch examples/grpo_countdown.py --help                # every key, its default and meaning
    asyncrl launch examples/grpo_countdown.py --resume runs/grpo-X  # continue a stopped run from its checkpoint

With no --model_path, a small Qwen2-shaped model and tokenizer are made locally and warm-started on
solver-written solutions (cached on disk, so only the first run pays for it). The run directory
gets config.json, metrics.jsonl, progress.json, summary.json, resumable checkpoints and the final
policy as a Hugging Face checkpoint. ``--resume RUN_DIR`` takes that run's config.json (overrides
given with it apply on top, e.g. ``--run.steps`` to go further) and its latest checkpoint.

Exit status: 0 done; 1 the run could not go on (its trainer died or hung: one line says why and
which checkpoint to resume from); 2 a usage error, one line naming the flag and what would be
accepted, found before anything is spawned or written: an unknown key (with the closest existing
ones), a value of the wrong type or out of range, a --model_path that is not a checkpoint
directory, a run directory that cannot be written or already holds a run, a --resume directory
that is not a run, a completion longer than the model's positions, a held-out set the warm start
saw (--run.check_weights with samplers that picked vLLM is found once they start); 130 stopped
by Ctrl-C (a second Ctrl-C during the shutdown kills the actors at once).
"""
# Copy this file and change what you like: everything below is the public API.

from __future__ import annotations

import sys

from asyncrl import Supervisor
from asyncrl.rl.config import GRPOConfig, help_text, parse_overrides, take_option

USAGE = "usage: asyncrl launch [LAUNCH FLAGS] grpo_countdown.py [--resume RUN_DIR] [--section.key VALUE ...]"
OPTIONS = [
    ("--help", "Show this help and exit."),
    ("--resume RUN_DIR", "Continue the run in RUN_DIR from its newest checkpoint, with its config.json; keys "
                         "given with it apply on top (e.g. --run.steps to go further)."),
]


async def main() -> int:
    argv = sys.argv[1:]
    config = GRPOConfig()
    if "--help" in argv or "-h" in argv:
        print(f"{USAGE}\n\n{__doc__.strip()}\n\n{help_text(config, OPTIONS)}")
        return 0
    # Every flag and path is checked here, before a process is spawned or a file written: a
    # mistake is a one-line ConfigError that `asyncrl launch` prints, exiting with status 2.
    resume, argv = take_option(argv, "--resume", "RUN_DIR")
    if not resume:  # the flags are parsed before the driver (torch and all) is imported: a typo answers at once
        config = parse_overrides(config, argv)
    from asyncrl.rl.driver import RunStoppedError, check_run, resumed_config, train

    if resume:  # the flags apply over the resumed run's config.json
        config = parse_overrides(resumed_config(config, resume), [*argv, "--run.run_dir", resume])
    config = check_run(config, resume=bool(resume))
    try:
        async with Supervisor() as sup:
            await train(config, sup, resume=bool(resume))
    except RunStoppedError as exc:  # every actor is gone by now (the supervisor stopped them)
        print(f"grpo_countdown: {exc}", file=sys.stderr)
        return 1
    return 0
