"""The scorer's prefill throughput and the trainer's step-time cost of on-policy distillation.

    python benchmarks/scorer.py --device cpu --shape tiny      # this machine
    python benchmarks/scorer.py --device cuda --shape 0.5b     # one GPU (not run yet)
    python benchmarks/scorer.py --judge --requests 16          # a generative judge's two reads

Throughput: a `ScorerActor` in its own process (one torch thread on CPU, as in a run) on a random
checkpoint of ``--shape`` (``benchmarks/packing.py``'s models), asked for the teacher log-probs of
``--requests`` Countdown-sized groups (``--group-size`` completions each, ``packing.py``'s
lengths) by ``--callers`` concurrent callers (a run's samplers: one per sampler pump). tokens/s
counts prompt and completion tokens scored; passes says how many forwards the requests shared.

Step cost: the trainer's ``train_share`` (in this process, one thread) on one batch of
``--prompts`` such groups, with ``distill_coef`` 0 and 1 (the teacher's log-probs given): the
median ``train_s`` of ``--steps`` steps each. It does not count what a run pays besides (the
scorer's process competing for the cores, the wait for a group's scores in the pump).

``--judge``: instead, a generative judge (``rl/scorer/judge.py``, the same random checkpoint, in
this process on one thread) on the same groups, read both ways: ``logprob`` (one forward of each
templated completion) and ``generate`` (greedy, ``--judge-tokens`` new tokens): completions per
CPU second (the wall time too, which other processes' load inflates).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "0.5b"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--callers", default="1,4")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--judge", action="store_true", help="measure a generative judge's two reads instead")
    parser.add_argument("--judge-tokens", type=int, default=8, help="new tokens of a generated verdict")
    args = parser.parse_args()
    from packing import make_batch, write_model

    with tempfile.TemporaryDirectory() as path:
        hint = write_model(path, args.shape)
        groups = make_batch("countdown", args.requests, args.group_size, hint, seed=0)
        if args.judge:
            judge_rates(path, args.device, groups, args.judge_tokens)
            return
        print(
            f"# {args.shape} on {args.device}, {args.requests} groups x {args.group_size} Countdown-sized completions"
        )
        print("| callers | passes | tokens | seconds | tokens/s |\n|---|---|---|---|---|")
        for callers in (int(c) for c in args.callers.split(",")):
            passes, tokens, seconds, scores = asyncio.run(throughput(path, args.device, groups, callers))
            print(f"| {callers} | {passes} | {tokens} | {seconds:.2f} | {tokens / seconds:.0f} |", flush=True)
        print(
            f"\n# trainer step, {args.prompts} groups x {args.group_size}\n| distill_coef | median train_s |\n|---|---|"
        )
        batch = [
            g.__class__(**{**{f: getattr(g, f) for f in g.__struct_fields__}, "teacher_logprobs": s})
            for g, s in zip(groups[: args.prompts], scores)
        ]
        for coef in (0.0, 1.0, 0.0, 1.0):  # alternated: the machine's load drifts
            print(f"| {coef:g} | {step_seconds(path, args.device, batch, coef, args.steps):.3f} |", flush=True)


async def throughput(path: str, device: str, groups: list, callers: int):
    from asyncrl.rl.scorer.actor import ScorerActor
    from asyncrl.runtime import Supervisor

    async with Supervisor(call_timeout_s=600) as sup:
        env = {"OMP_NUM_THREADS": "1"} if device == "cpu" else {}
        scorer = await sup.spawn(
            ScorerActor, path, name="scorer", gpus=int(device == "cuda"), env=env, kwargs={"device": device}
        )
        await scorer.teacher_logprobs(groups[0].prompt_ids, groups[0].completion_ids)  # warm-up
        before = await scorer.stats()
        queue = list(range(len(groups)))
        scores: list = [None] * len(groups)

        async def caller():
            while queue:
                i = queue.pop(0)
                scores[i] = await scorer.teacher_logprobs(groups[i].prompt_ids, groups[i].completion_ids)

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        seconds = time.perf_counter() - start
        after = await scorer.stats()
        return after["passes"] - before["passes"], after["tokens"] - before["tokens"], seconds, scores


JUDGE_TEMPLATE = "Problem: {prompt}\nAnswer: {completion}\nIs the answer correct? The answer is"


def judge_rates(path: str, device: str, groups: list, new_tokens: int) -> None:
    import torch

    from asyncrl.rl.scorer.judge import Judge

    torch.set_num_threads(1)
    requests = [(g.prompt_ids, g.completion_ids) for g in groups]
    n = sum(len(c) for _, c in requests)
    print(
        "| judge_read | completions | forwards or generate calls | wall s | CPU s | completions per CPU s |\n"
        "|---|---|---|---|---|---|"
    )
    for read in ("logprob", "generate"):
        judge = Judge(
            path,
            path,
            JUDGE_TEMPLATE,
            read=read,
            verdict_tokens=("y", "n"),
            max_new_tokens=new_tokens,
            device=torch.device(device),
        )
        judge.score(requests[:1], 16384)  # warm-up
        start, cpu = time.perf_counter(), time.process_time()  # CPU time: this machine's load moves the wall's
        _, calls = judge.score(requests, 16384)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"| {read} | {n} | {calls} | {seconds:.2f} | {cpu:.2f} | {n / cpu:.0f} |", flush=True)


def step_seconds(path: str, device: str, batch: list, coef: float, steps: int) -> float:
    import torch

    from asyncrl.rl.config.trainer import GRPOLossConfig, TrainerConfig
    from asyncrl.rl.trainer.actor import TrainerActor

    torch.set_num_threads(1)
    trainer = TrainerActor(path, TrainerConfig(loss=GRPOLossConfig(distill_coef=coef)), device=device)
    times = [trainer.train_share(batch).train_s for _ in range(steps + 1)][1:]  # the first: warm-up
    return statistics.median(times)


if __name__ == "__main__":
    main()
