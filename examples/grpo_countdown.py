"""Fully-async GRPO on Countdown: a small model learns to reach a target with + - * / and parentheses.

    asyncrl launch examples/grpo_countdown.py                       # embedded model, CPU or GPU
    asyncrl launch examples/grpo_countdown.py --run.mode sync       # the synchronous baseline
    asyncrl launch examples/grpo_countdown.py --model_path ~/ckpt/Qwen2.5-0.5B-Instruct --trainer.lr 1e-6
    asyncrl launch examples/grpo_countdown.py --help                # every key, its default and meaning

With no --model_path, a small Qwen2-shaped model and tokenizer are made locally and warm-started on
solver-written solutions (cached on disk, so only the first run pays for it). The run directory
gets config.json, metrics.jsonl, summary.json and the final policy as a Hugging Face checkpoint.
Copy this file and change what you like: everything below is the public API.
"""

from __future__ import annotations

import sys

from asyncrl import Supervisor
from asyncrl.rl.config import help_text, parse_overrides
from asyncrl.rl.grpo import GRPOConfig, train


async def main() -> None:
    argv = sys.argv[1:]
    config = GRPOConfig()
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(help_text(config))
        return
    config = parse_overrides(config, argv)
    async with Supervisor() as sup:
        await train(config, sup)
