"""A teacher for on-policy distillation of the default student (issue 33): a larger embedded
model, warm-started longer the way the default model is (``model/warm_start.py``), then trained
by GRPO on Countdown's train split; both stages cached, and the teacher's path printed last.

    python benchmarks/make_teacher.py                      # the shape and steps below
    python benchmarks/make_teacher.py --grpo-steps 0       # the warm start alone
    python benchmarks/make_teacher.py --steps 600 --grpo-steps 50   # shorter, for a smoke run

Why the GRPO stage: distillation moves the student toward the teacher's *sampling* distribution,
so what the teacher can give is its sampled solve rate, not its greedy one. The warm start alone
(1000 steps) solved 0.38 greedy but 0.31 sampled at the run's temperature; 400 GRPO steps made
that 0.53 / 0.49 (benchmarks/README.md, "Distillation from a GRPO-trained teacher").

It shares the student's tokenizer (the embedded byte-level one) and its Countdown splits
(``data_seed`` 0, the same held-out reserve), so a run's held-out problems are unseen by both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.model.warm_start import cache_root, default_model

TEACHER = ModelConfig(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2, intermediate_size=768)
"""~2.2x the default's parameters (head_dim 32, which vLLM's CPU attention takes)."""


def grpo_trained(warm_path: str, steps: int, seed: int) -> str:
    """The final policy of a GRPO run of ``steps`` on ``warm_path`` (the default example's
    settings otherwise), cached beside the models: a run directory with a summary.json is whole,
    any other is a crashed run's and is started again."""
    run_dir = os.path.join(cache_root(), "teachers", f"{os.path.basename(warm_path)}-grpo{steps}-seed{seed}")
    if not os.path.isfile(os.path.join(run_dir, "summary.json")):
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "grpo_countdown.py")
        cmd = [sys.executable, "-m", "asyncrl.cli", "launch", example, "--model_path", warm_path]
        cmd += ["--run.steps", str(steps), "--run.seed", str(seed), "--run.run_dir", run_dir]
        cmd += ["--run.eval_every", str(max(steps // 4, 1))]
        subprocess.run(cmd, check=True)
    return os.path.join(run_dir, "final")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="warm-start steps (the default model: 400)")
    parser.add_argument("--grpo-steps", type=int, default=400, help="GRPO steps after the warm start (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="the GRPO stage's --run.seed")
    parser.add_argument("--threads", type=int, default=1, help="threads of the evaluation after training")
    args = parser.parse_args()
    path = default_model(TEACHER, WarmStartConfig(steps=args.steps), threads=args.threads)
    if args.grpo_steps:
        path = grpo_trained(path, args.grpo_steps, args.seed)
    print(path)


if __name__ == "__main__":
    main()
