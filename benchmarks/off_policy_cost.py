"""What the off-policy corrections (``--trainer.loss.decoupled``, the masks) cost a train step, and
what a second, no-grad forward pass for pi_prox would cost (decoupled 'recompute' takes pi_prox
from the step's own forward instead: docs/algorithms.md).

    python benchmarks/off_policy_cost.py                 # the embedded model's shape, this CPU
    python benchmarks/off_policy_cost.py --steps 30 --threads 1

One trainer (``TrainerActor`` in this process, the embedded 1.02M-parameter shape with random
weights: a step's cost does not depend on them) on a Countdown-shaped batch (``packing.py``'s
``countdown`` lengths, ``--prompts`` groups of ``--group-size``), its tokens sampled at versions
0-2 while the trainer holds version 2. Each round times one step of every loss configuration in
turn (interleaved, so a change of the machine's load falls on all of them alike) and one no-grad
forward over the same micro-batches (``scored_logprobs``: what a recomputed pi_prox would add);
the table gives the medians over ``--steps`` rounds after ``--warmup``, and each as a share of the
default loss's step. A step's time moves by several percent from round to round on a shared
machine, more than the corrections' elementwise work: the second table times the loss function
alone (forward and backward of ``grpo_loss`` on the step's log-probs, with the tally the step
record gets), ``--loss-calls`` calls per configuration, the median.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="groups per batch (default example: 16)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per group (default example: 8)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the trainer actor runs)")
    parser.add_argument("--loss-calls", type=int, default=200, help="calls of the loss alone per configuration")
    args = parser.parse_args()

    import msgspec
    import torch

    from asyncrl.rl.config.trainer import GRPOLossConfig, TrainerConfig
    from asyncrl.rl.rollout import VersionSpan
    from asyncrl.rl.scoring.logprobs import scored_logprobs
    from asyncrl.rl.trainer.actor import TrainerActor
    from asyncrl.rl.trainer.batching import micro_batches
    from asyncrl.rl.trainer.loss import grpo_loss, step_advantages
    from packing import make_batch, write_model

    torch.set_num_threads(args.threads)
    losses = {
        "default (PPO clip against mu)": GRPOLossConfig(),
        "decoupled recompute": GRPOLossConfig(decoupled="recompute"),
        "decoupled loglinear": GRPOLossConfig(decoupled="loglinear"),
        "IcePop: recompute + token_mask 0.5,5": GRPOLossConfig(decoupled="recompute", token_mask=(0.5, 5.0)),
        "every option: loglinear, token 0.5,5, seq 0.99,1.01, OPSM 0.1": GRPOLossConfig(
            decoupled="loglinear", token_mask=(0.5, 5.0), seq_mask=(0.99, 1.01), opsm_delta=0.1
        ),
    }
    with tempfile.TemporaryDirectory(prefix="asyncrl-off-policy-") as path:
        hint = write_model(path, "tiny")
        batch = make_batch("countdown", args.prompts, args.group_size, hint, seed=0)
        batch = [  # a third of the groups two versions old, a third one version, with a switch mid-way
            msgspec.structs.replace(
                g,
                version=g.prompt_id % 3,
                version_spans=[[VersionSpan(0, g.prompt_id % 3), VersionSpan(len(c) // 2, 2)] for c in g.completion_ids]
                if g.prompt_id % 3 < 2
                else [],
            )
            for g in batch
        ]
        base = TrainerConfig(micro_batch_tokens=16384, temperature=1.0)
        trainer = TrainerActor(path, base)
        trainer.policy.steps = 2
        cut = micro_batches(batch, step_advantages(batch, base.loss, False), 16384, trainer.device)
        fused = not trainer.fallback_reason()
        times: dict[str, list[float]] = {name: [] for name in [*losses, "a second, no-grad forward"]}
        for round_ in range(args.warmup + args.steps):
            for name, loss in losses.items():
                trainer.config = dataclasses.replace(base, loss=loss)
                trainer.policy.steps = 2  # the same lags every step
                seconds = trainer.train_share(batch).train_s
                if round_ >= args.warmup:
                    times[name].append(seconds)
            start = time.perf_counter()
            with torch.no_grad():
                for b in cut:
                    scored_logprobs(trainer.model, b, 1.0, fused=fused)
            if round_ >= args.warmup:
                times["a second, no-grad forward"].append(time.perf_counter() - start)
        (b,) = cut
        with torch.no_grad():
            logprobs, _ = scored_logprobs(trainer.model, b, 1.0, fused=fused)
        lag = 2 - b.versions
        loss_ms = {}
        for name, loss in losses.items():
            calls = []
            for _ in range(args.loss_calls):
                new = logprobs.clone().requires_grad_()
                start = time.perf_counter()
                value, _ = grpo_loss(
                    new, b.behaviour, b.advantages, b.mask, loss, token_lag=lag, normalizer=1.0, with_tally=True
                )
                value.backward()
                calls.append(time.perf_counter() - start)
            loss_ms[name] = 1000 * statistics.median(calls)
    tokens = sum(len(c) for g in batch for c in g.completion_ids)
    default = statistics.median(times["default (PPO clip against mu)"])
    print(
        f"# embedded shape (1.02M), {args.prompts}x{args.group_size} completions, {tokens} completion tokens, "
        f"{len(cut)} micro-batch(es), {args.threads} thread(s), median of {args.steps} rounds"
    )
    print("| what | seconds | share of the default step |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.4f} | {median / default:.3f} |")
    print(
        f"\n| the loss alone ({b.mask.shape[0]} x {b.mask.shape[1]}), forward and backward | ms | share of the step |"
    )
    print("|---|---|---|")
    for name, ms in loss_ms.items():
        print(f"| {name} | {ms:.2f} | {ms / 1000 / default:.4f} |")


if __name__ == "__main__":
    main()
