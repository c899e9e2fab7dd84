"""A larger embedded model, warm-started longer: a teacher for on-policy distillation of the
default student (issue 33), made the way the default model is (``model/warm_start.py``), cached
under its own key, and its path printed last.

    python benchmarks/make_teacher.py                 # the shape and steps below
    python benchmarks/make_teacher.py --steps 600     # shorter, for a smoke run

It shares the student's tokenizer (the embedded byte-level one) and its Countdown splits
(``data_seed`` 0, the same held-out reserve), so a run's held-out problems are unseen by both.
"""

from __future__ import annotations

import argparse

from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.model.warm_start import default_model

TEACHER = ModelConfig(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2, intermediate_size=768)
"""~2.2x the default's parameters (head_dim 32, which vLLM's CPU attention takes)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="warm-start steps (the default model: 400)")
    parser.add_argument("--threads", type=int, default=1, help="threads of the evaluation after training")
    args = parser.parse_args()
    path = default_model(TEACHER, WarmStartConfig(steps=args.steps), threads=args.threads)
    print(path)


if __name__ == "__main__":
    main()
