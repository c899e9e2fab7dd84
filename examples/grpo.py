"""Fully-async GRPO on your own task: a task class, or a data file and a reward function.

    asyncrl launch examples/grpo.py --task.name my_task.py:MyTask --model_path ~/ckpt/Qwen2.5-0.5B-Instruct
    asyncrl launch examples/grpo.py --task.data problems.jsonl --task.reward my_reward.py:reward --model_path ~/ckpt
    asyncrl launch examples/grpo.py --task.name my_task.py:MyTask --help   # its options too (--my_task.*)
    asyncrl launch examples/grpo.py --resume runs/grpo-X                   # continue a stopped run
    asyncrl launch examples/grpo.py                                        # no task flags: Countdown

A task is a subclass of asyncrl.rl.tasks.Task (or Environment, for several turns) in a file of
yours, named as FILE.py:CLASS (or MODULE:CLASS); its own options (a frozen dataclass ``Config`` on
the class) become the section ``--<task name>.*``. A data file is JSONL (one JSON object per line)
or Parquet; with ``--task.reward FILE.py:FUNCTION`` each row's ``prompt`` (``--task.prompt_key``)
is asked and ``FUNCTION(row, completion)`` scores the answer (a float, or a Score; sync or async).
Held-out problems are a seeded share of the rows (``--run.n_heldout``), or ``--task.heldout_data``.
docs/tasks.md is the guide.

Without --model_path, a small model is made locally and warm-started on the task's demonstrations
(``Task.demonstration``, or a row's ``"demonstration"`` string), cached on disk. The run directory
gets config.json, metrics.jsonl (the task's own metrics as task/<name>), progress.json,
summary.json, resumable checkpoints and the final policy as a Hugging Face checkpoint.

Exit status: 0 done; 1 the run could not go on (its trainer died or hung, or more than
--task.max_failure_rate of the task's scores failed: one line says why and which checkpoint to
resume from); 2 a usage error, one line naming the flag and what would be accepted, found before
anything is spawned or written: an unknown key, a bad value, a task file that fails to import or
has no such class, a data file that is missing, empty or has a malformed line (file and line
named), too few problems for the held-out split, a bad --model_path or run directory; 130 stopped
by Ctrl-C (a second Ctrl-C during the shutdown kills the actors at once).
"""
# Copy this file and change what you like: everything below is the public API. To make your task
# the default of your copy, pass default_task="my_task.py:MyTask".

from __future__ import annotations

import sys

from asyncrl.rl.launch import grpo_main

# A new task starts from the settings measured best on Countdown (examples/grpo_countdown.py:
# sampling at 0.7 and a cosine learning rate doubled, then more, the held-out gain of sampling at 1
# with a constant rate); --sampler.temperature 1 --trainer.lr_schedule constant gives the config's own.
DEFAULTS = ["--sampler.temperature", "0.7", "--trainer.lr_schedule", "cosine"]


async def main() -> int:
    return await grpo_main(sys.argv[1:], __doc__, defaults=DEFAULTS)
