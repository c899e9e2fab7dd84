"""Warm-start benchmark of the embedded default policy: wall time of the supervised warm start,
model size, and held-out solve rates (greedy, and sampled at temperature 1 as GRPO samples).

Builds into a fresh temporary cache unless ``--cache-dir`` is given, so the warm start is timed
even when the user's cache already holds the model. The held-out problems are the first ``--eval``
of ``train_and_heldout(data_seed, ...)``'s held-out split, which the warm start never trains on.

    python benchmarks/warm_start.py                       # defaults, ~3 minutes on 2 CPU cores
    python benchmarks/warm_start.py --steps 300 --json    # a shorter warm start, one JSON line
    python benchmarks/warm_start.py --shape 0.5b --device cuda --lr 3e-4   # Qwen2-0.5B's layers, on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

SHAPES = {  # ModelConfig fields; "0.5b": Qwen2-0.5B's layers (its 151,936-entry vocabulary is the tokenizer's here)
    "embedded": {},
    "0.5b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="override WarmStartConfig.steps")
    parser.add_argument("--batch-size", type=int, help="override WarmStartConfig.batch_size")
    parser.add_argument("--lr", type=float, help="override WarmStartConfig.lr")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads of the evaluation after the warm start (training "
        "always uses one, for bit-exact results; default: the usable cores, at most 4)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where it trains and evaluates")
    parser.add_argument(
        "--shape", default="embedded", choices=sorted(SHAPES), help="the model's layers (vocabulary: the tokenizer's)"
    )
    parser.add_argument("--eval", type=int, default=200, help="held-out problems to evaluate (default 200)")
    parser.add_argument("--samples", type=int, default=4, help="T=1 samples per problem (default 4)")
    parser.add_argument("--cache-dir", help="cache root to build into (default: a fresh temporary one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args()

    import torch  # after argparse, so --help is instant

    from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
    from asyncrl.rl.model.evaluation import solve_rate
    from asyncrl.rl.model.policy import load_policy
    from asyncrl.rl.model.warm_start import default_model
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout

    overrides = {k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size), ("lr", args.lr)) if v}
    warm = dataclasses.replace(WarmStartConfig(), device=args.device, **overrides)
    model_cfg = ModelConfig(**SHAPES[args.shape])
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    with tempfile.TemporaryDirectory() as scratch:
        start = time.monotonic()
        path = default_model(
            model_cfg, warm, Countdown(), cache_dir=args.cache_dir or scratch, threads=args.threads, log=log
        )
        build_s = time.monotonic() - start
        model, tokenizer, fmt = load_policy(path)
        model.to(args.device)
        with open(f"{path}/asyncrl_model.json") as f:
            marker = json.load(f)
    _, heldout = train_and_heldout(warm.data_seed, 0, args.eval)
    torch.manual_seed(0)
    start = time.monotonic()
    greedy = solve_rate(model, tokenizer, fmt, heldout, task=Countdown())
    sampled = solve_rate(model, tokenizer, fmt, heldout, greedy=False, n=args.samples, task=Countdown())
    result = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "build_s": round(build_s, 1),
        "warm_start_s": marker["warm_start_wall_s"],
        "final_loss": marker["final_loss"],
        "trained_on": marker["trained_on"],
        "heldout": len(heldout),
        "greedy_solve_rate": greedy,
        "sampled_t1_solve_rate": sampled,
        "eval_s": round(time.monotonic() - start, 1),
        "threads_arg": args.threads,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "warm": dataclasses.asdict(warm),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
