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
given with it apply on top, e.g. ``--run.steps`` to go further) and its latest checkpoint. A run
that cannot go on (its trainer died or hung) exits with status 1 and one line saying why; a
setting the run refuses (a held-out set the warm start saw, --run.check_weights with vLLM
samplers, a run directory holding another run's checkpoints) exits with status 2.
Copy this file and change what you like: everything below is the public API.
"""

from __future__ import annotations

import sys

from asyncrl import Supervisor
from asyncrl.rl.checkpoint import load_run_config
from asyncrl.rl.config import ConfigError, help_text, parse_overrides
from asyncrl.rl.grpo import GRPOConfig, train
from asyncrl.rl.recovery import RunStoppedError


async def main() -> int:
    argv = sys.argv[1:]
    config = GRPOConfig()
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(help_text(config))
        return 0
    resume = ""
    if "--resume" in argv:
        at = argv.index("--resume")
        if at + 1 >= len(argv):
            sys.exit("--resume needs a run directory")
        resume = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
        config = load_run_config(config, resume)
        argv += ["--run.run_dir", resume]
    config = parse_overrides(config, argv)
    try:
        async with Supervisor() as sup:
            await train(config, sup, resume=bool(resume))
    except RunStoppedError as exc:  # every actor is gone by now (the supervisor stopped them)
        print(f"grpo_countdown: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # a setting the run refuses, found before training began
        print(f"grpo_countdown: {exc}", file=sys.stderr)
        return 2
    return 0
