"""The warm start's supervised training loop (`warm_start.py` builds the model and its rows,
`demonstrations.py` the rows): AdamW on next-token cross-entropy over the task's demonstrations,
on whatever device the model is on."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch

from asyncrl.rl.config.model import WarmStartConfig
from asyncrl.rl.model.evaluation import check_stop


def lr_factor(step: int, warm: WarmStartConfig) -> float:
    """The learning rate's multiplier at ``step``: linear warm-up, then cosine decay to a tenth."""
    if step < warm.warmup_steps:
        return (step + 1) / warm.warmup_steps
    progress = (step - warm.warmup_steps) / max(1, warm.steps - warm.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_on_demonstrations(
    model,
    ids,
    labels,
    lengths,
    warm: WarmStartConfig,
    log: Callable[[str], object],
    stop: threading.Event | None = None,
) -> float:
    """Next-token cross-entropy on the completions (``labels``: -100 elsewhere), on the device the
    model is on; returns the mean loss of the last 20 steps."""
    model.train()
    device = next(model.parameters()).device
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": warm.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=warm.lr,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warm))
    gen = torch.Generator().manual_seed(warm.seed)
    order, cursor = torch.randperm(len(ids), generator=gen), 0
    recent: list[float] = []
    start = time.monotonic()
    for step in range(warm.steps):
        check_stop(stop)
        if cursor + warm.batch_size > len(order):  # a fresh permutation per epoch
            order, cursor = torch.randperm(len(ids), generator=gen), 0
        batch = order[cursor : cursor + warm.batch_size]
        cursor += warm.batch_size
        width = int(lengths[batch].max())
        # Right padding needs no attention mask: causal attention never lets a real token see a
        # later pad, and pads carry no label. Without a mask, SDPA takes its fast causal path.
        out = model(input_ids=ids[batch, :width].to(device), labels=labels[batch, :width].to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = (recent + [out.loss.item()])[-20:]
        if (step + 1) % max(1, warm.steps // 10) == 0 or step + 1 == warm.steps:
            log(
                f"[model] step {step + 1}/{warm.steps} loss {sum(recent) / len(recent):.3f} "
                f"({time.monotonic() - start:.0f} s)"
            )
    model.eval()
    return sum(recent) / len(recent)
