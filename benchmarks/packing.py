"""Trainer throughput with packed sequences against padded rows (``--trainer.pack_tokens``).

    python benchmarks/packing.py --device cpu --shape tiny                   # this machine
    python benchmarks/packing.py --device cuda --shape 0.5b --attn sdpa      # one GPU
    python benchmarks/packing.py --device cuda --shape 0.5b --attn flash_attention_2   # needs flash-attn

A "step" is one call of the trainer's ``train_step`` endpoint, made in this process (micro-batching,
forward, backward, AdamW), timed by the trainer itself (``train_s``), on a batch of ``--prompts``
groups of ``--group-size``
completions. tokens/s counts real tokens (prompt + completion), never padding. The lengths:

- ``countdown`` (the default example): the compact Countdown prompts and the solver's answers in
  answer tags plus an end token, which is what the warm-started policy writes (its completions
  stop at the hint, longest answer + 8, when they do not stop earlier); a tenth run to the hint;
- ``long_tail``: a chat-sized prompt (100-160 tokens) and completions uniform in 1..512, the
  spread of a model whose answers vary in length (where padding costs the most).

Models: ``tiny`` is the embedded default (1.02M parameters), ``0.5b`` Qwen2-0.5B's shape (random
weights, fp32 parameters, bf16 autocast on GPU as the trainer runs). Each configuration runs
``--warmup`` steps, then ``--steps`` timed ones; the table shows the median, and on a GPU the peak
memory a step allocated (parameters, gradients, AdamW state and activations together).

``--lora-rank R`` trains LoRA adapters instead of every parameter (``--trainer.lora.rank``, alpha
2R), ``--bf16-base`` keeps the frozen base in bf16: the figures behind docs/lora.md's memory table

    python benchmarks/packing.py --device cuda --shape 0.5b --pack-tokens "" --lora-rank 16 --bf16-base
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.rl.trainer.metrics import TrainStepMetrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "0.5b"])
    parser.add_argument("--lengths", default="countdown", choices=["countdown", "long_tail"])
    parser.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager, flash_attention_2)")
    parser.add_argument("--pack-tokens", default="256,1024", help="row budgets to try, comma-separated")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="--trainer.micro_batch_tokens")
    parser.add_argument("--prompts", type=int, default=8, help="groups per batch (default example: 8)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per group (default example: 8)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on CPU (default 1, as the trainer actor runs)"
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every parameter)"
    )
    parser.add_argument("--bf16-base", action="store_true", help="with --lora-rank: the frozen base in bf16 (GPU)")
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="--trainer.activation_checkpointing: layers recompute their activations in the backward",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()

    import torch  # after argparse: --help is instant

    from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig
    from asyncrl.rl.trainer.actor import TrainerActor

    lora = LoRAConfig(rank=args.lora_rank, alpha=2 * max(args.lora_rank, 1), bf16_base=args.bf16_base)

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="asyncrl-packing-") as path:
        hint = write_model(path, args.shape)
        batch = make_batch(args.lengths, args.prompts, args.group_size, hint, seed=0)
        real = sum(len(g.prompt_ids) + len(c) for g in batch for c in g.completion_ids)
        rows = []
        for pack in [0] + [int(x) for x in args.pack_tokens.split(",") if x]:
            config = TrainerConfig(
                micro_batch_tokens=args.micro_batch_tokens,
                pack_tokens=pack,
                attn_implementation=args.attn,
                temperature=1.0,
                lora=lora,
                activation_checkpointing=args.activation_checkpointing,
            )
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            trainer = TrainerActor(path, config, device=args.device)
            steps = asyncio.run(train_steps(trainer, batch, args.warmup + args.steps))
            metrics = steps[-1]
            seconds = statistics.median(m.train_s for m in steps[args.warmup :])
            padded_tokens = padded_size(torch.device(args.device), batch, config)
            rows.append(
                {
                    "layout": f"packed {pack}" if pack else "padded",
                    "micro_batches": int(metrics.micro_batches),
                    "tokens_in_forward": padded_tokens,
                    "real_tokens": real,
                    "step_s": round(seconds, 4),
                    "tokens_per_s": round(real / seconds, 1),
                    "loss": metrics.loss,
                    "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
                }
            )
            del trainer
            if args.device == "cuda":
                gc.collect()  # the next row's peak must not include this trainer
                torch.cuda.empty_cache()
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / base, 3)
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return
    trained = f"LoRA rank {lora.rank}{', bf16 base' if lora.bf16_base else ''}" if lora.rank else "every parameter"
    trained += ", activation checkpointing" if args.activation_checkpointing else ""
    print(
        f"# {args.shape} on {args.device} ({args.attn}), {args.lengths} lengths, {args.prompts}x{args.group_size} "
        f"sequences, {real} real tokens per batch, median of {args.steps} steps, {trained} trained"
    )
    print(
        "| layout | micro-batches | tokens in forward (padding incl.) | step s | real tokens/s | vs padded | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(
            f"| {r['layout']} | {r['micro_batches']} | {r['tokens_in_forward']} | {r['step_s']:.4f} | "
            f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {peak} |"
        )
    print(
        "loss of the last step per layout (the same steps from the same weights: equal up to rounding): "
        + ", ".join(f"{r['loss']:.6f}" for r in rows)
    )


def write_model(path: str, shape: str) -> int:
    """A random Qwen2 of ``shape`` with the project's tokenizer at ``path``; returns the completion
    hint of the default example (longest answer + 8)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.rl.config.model import ModelConfig
    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.model.warm_start import new_model

    tok = build_tokenizer()
    torch.manual_seed(0)
    if shape == "tiny":
        model = new_model(ModelConfig(), tok)
    else:  # Qwen2-0.5B's shape; the vocabulary is the embedded tokenizer's ids padded to Qwen's size
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=151936,
                hidden_size=896,
                intermediate_size=4864,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                max_position_embeddings=32768,
                tie_word_embeddings=True,
                use_sliding_window=False,
                bos_token_id=None,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    hint = 40
    with open(f"{path}/{MARKER_FILE}", "w") as f:
        json.dump({"prompt_style": "compact", "max_new_tokens_hint": hint}, f)
    return hint


def make_batch(lengths: str, prompts: int, group_size: int, hint: int, seed: int):
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.rollout import RolloutGroup
    from asyncrl.rl.tasks.countdown import Countdown, format_prompt_compact, format_reference

    rng = random.Random(seed)
    tok = build_tokenizer()
    groups = []
    problems = list(Countdown().splits(seed, prompts, 1).train)
    for g in range(prompts):
        if lengths == "countdown":
            prompt = tok(format_prompt_compact(problems[g]), add_special_tokens=False)["input_ids"]
            answer = tok(format_reference(problems[g]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            sizes = [
                hint if rng.random() < 0.1 else max(1, len(answer) + rng.randrange(-4, 5)) for _ in range(group_size)
            ]
        else:
            prompt = [rng.randrange(3, 40) for _ in range(rng.randrange(100, 161))]
            answer = []
            sizes = [rng.randrange(1, 513) for _ in range(group_size)]
        completions = [[(answer[j] if j < len(answer) else rng.randrange(3, 40)) for j in range(n)] for n in sizes]
        lps = [[-rng.uniform(0.1, 3.0) for _ in c] for c in completions]
        rewards = [rng.choice([0.0, 0.1, 1.0]) for _ in completions]
        groups.append(RolloutGroup(g, prompt, completions, lps, rewards, version=0))
    return groups


async def train_steps(trainer, batch, n: int) -> list[TrainStepMetrics]:
    """``n`` steps on ``batch`` through the trainer's public endpoint; each one's metrics."""
    return [await trainer.train_step(batch) for _ in range(n)]


def padded_size(device, batch, config) -> int:
    """Tokens the forward passes process, padding included."""
    from asyncrl.rl.trainer.batching import micro_batches
    from asyncrl.rl.trainer.loss import group_advantages
    from asyncrl.rl.trainer.packing import packed_micro_batches

    adv = group_advantages([list(g.rewards) for g in batch])
    if config.pack_tokens:
        cut = packed_micro_batches(batch, adv, config.micro_batch_tokens, device, config.pack_tokens)
    else:
        cut = micro_batches(batch, adv, config.micro_batch_tokens, device)
    return sum(b.input_ids.numel() for b in cut)


if __name__ == "__main__":
    main()
