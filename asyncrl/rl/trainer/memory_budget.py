"""``--trainer.micro_batch_tokens 0`` (auto): the token budget of one micro-batch, chosen from the
device memory left once the policy (and a colocated vLLM engine) holds its share.

The estimate is a pure function (`auto_micro_batch_tokens`) so that it can be read and tested
without a GPU; `free_training_bytes` measures its input on the trainer's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from asyncrl.rl.config.trainer import AUTO_CPU_MICRO_BATCH_TOKENS, AUTO_MICRO_BATCH_TOKENS_MAX
from asyncrl.rl.scoring.chunked_head import DEFAULT_CHUNK_BYTES

AUTO_MIN_TOKENS = 1024
"""The least auto ever picks (and its rounding step): below it a step is mostly launch overhead."""
USABLE_SHARE = 0.85
"""Share of the measured free memory the estimate plans for: the rest is the caching allocator's
fragmentation, cuBLAS/NCCL workspaces and the KL reference's transient forward."""
RESERVE_BYTES = 1 << 30
"""Subtracted outright: the CUDA context's late allocations and the optimiser step's temporaries."""


def layer_bytes_per_token(hidden_size: int, intermediate_size: int, num_heads: int) -> int:
    """Bytes one decoder layer keeps per token for its backward under bf16 autocast, fp32 weights:

    - two RMSNorms: fp32 input (4H each) and the bf16 cast of the output the projections read (2H each): 12H;
    - q, k, v and rotary's q, k in bf16: at most 5 x 2H = 10H (less under GQA);
    - attention output, o_proj output, two fp32 residual sums: 2H + 2H + 2 x 4H = 12H;
    - the MLP's gate, up, act(gate), act(gate) x up in bf16 (4 x 2I) and down's output (2H): 8I + 2H;
    - sdpa's logsumexp: 4 B a head.

    That is 36H + 8I + 4 x heads, rounded up to 40H + 10I for what the list leaves out (rotary's
    cos/sin, masks, casts autocast keeps). Checked against a measured 0.5B-shaped step's
    activations on a GPU (benchmarks/README.md, "Figures that were in the code").
    """
    return 40 * hidden_size + 10 * intermediate_size + 4 * num_heads


def auto_micro_batch_tokens(
    free_bytes: int,
    *,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int,
    num_heads: int,
    vocab_size: int,
    checkpointing: bool,
    full_logits: bool = False,
) -> int:
    """Tokens of one micro-batch that fit in ``free_bytes`` (device memory free for activations:
    the weights, gradients and optimiser state already taken out), clamped to
    [`AUTO_MIN_TOKENS`, `AUTO_MICRO_BATCH_TOKENS_MAX`] and rounded down to a multiple of 1024.

    Per token: ``num_layers`` x `layer_bytes_per_token`, or with ``checkpointing`` each layer's
    fp32 input (4H) plus one layer's activations (the one recomputed in the backward); then 16H
    for the embeddings' output, the final norm and the gathered hidden states; and with
    ``full_logits`` (the fallback path, ``scoring/logprobs.py``) 12 B a vocabulary entry: the fp32
    logits kept for the backward and their bf16 original, then in the backward their fp32 and bf16
    gradients (the first estimate, half of that, ran out of memory on a GPU at the 0.5B shape; the
    measured figure is in benchmarks/README.md, issue 28). Fixed: the chunked head's
    temporaries (4 chunks) and its bf16 weight copy and fp32 gradient sum (6 B x V x H)."""
    layer = layer_bytes_per_token(hidden_size, intermediate_size, num_heads)
    per_token = (num_layers * 4 * hidden_size + layer) if checkpointing else num_layers * layer
    per_token += 16 * hidden_size + (12 * vocab_size if full_logits else 0)
    fixed = 4 * DEFAULT_CHUNK_BYTES + 6 * vocab_size * hidden_size + RESERVE_BYTES
    usable = int(free_bytes * USABLE_SHARE) - fixed
    tokens = max(usable, 0) // per_token
    tokens = min(max(tokens, AUTO_MIN_TOKENS), AUTO_MICRO_BATCH_TOKENS_MAX)
    return tokens // AUTO_MIN_TOKENS * AUTO_MIN_TOKENS


def free_training_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Device memory a step's activations may use: free now (``mem_get_info``: what a colocated
    vLLM engine holds is already gone) plus what torch's cache holds unused, less the gradients
    and AdamW's two fp32 states that the first step has yet to allocate."""
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pending = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: the shard this rank holds
        size = local.numel() * local.element_size()
        pending += size if p.grad is None else 0
        pending += 2 * size if not optimizer.state.get(p) else 0
    return max(free - pending, 0)


def model_shape(config) -> dict[str, int]:
    """The numbers `auto_micro_batch_tokens` reads, from a transformers config (the text part of a
    multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        num_heads=text.num_attention_heads,
        vocab_size=text.vocab_size,
    )


def resolve_micro_batch_tokens(
    configured: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    checkpointing: bool,
    full_logits: bool,
    pack_tokens: int = 0,
) -> tuple[int, int]:
    """The budget to cut micro-batches by, and the free bytes it was chosen from (0 where none
    was measured): ``configured`` where set; auto on CPU `AUTO_CPU_MICRO_BATCH_TOKENS` (the old
    default: a CPU run is unchanged); auto on CUDA the estimate, at least ``pack_tokens`` (a
    packed row is one forward)."""
    if configured:
        return configured, 0
    if device.type != "cuda":
        return max(AUTO_CPU_MICRO_BATCH_TOKENS, pack_tokens), 0
    free = free_training_bytes(model, optimizer, device)
    tokens = auto_micro_batch_tokens(
        free, **model_shape(model.config), checkpointing=checkpointing, full_logits=full_logits
    )
    return max(tokens, pack_tokens), free


@dataclass
class AutoBudget:
    """Auto's budget through a run. Chosen at the first step that asks (the policy is on its device
    then, a colocated vLLM engine has taken its share, the optimiser state yet to come is counted),
    and chosen again with activation checkpointing on at the first step, whichever it is, whose
    longest sequence is more than the budget without it: completions grow as a run learns, so the
    first step's longest says little about a later one's."""

    measure: Callable[[bool], tuple[int, int]]
    """Checkpointing on or not -> (tokens, free bytes it was chosen from; 0: none measured)."""
    checkpointing: bool
    """On now (``--trainer.activation_checkpointing true``, or turned on here)."""
    may_turn_on: bool
    """``--trainer.activation_checkpointing`` auto, one trainer process on a GPU."""
    tokens: int = 0
    free: int = 0
    said: list[str] = field(default_factory=list)
    """What changed at the last `fit`, as log lines."""

    def fit(self, longest: int) -> bool:
        """The budget for a step whose longest sequence (prompt and completion) is ``longest``, in
        `tokens`; True where checkpointing must go on now (the caller turns it on in the model)."""
        self.said = []
        if not self.tokens:
            self._choose()
        if longest <= self.tokens or not self.may_turn_on or self.checkpointing:
            return False
        without, self.checkpointing = self.tokens, True
        self.said.append(
            f"activation checkpointing on (auto): a sequence of {longest} tokens is more than the {without} "
            "a micro-batch holds without it"
        )
        self._choose()
        return True

    def most(self) -> tuple[int, int]:
        """The most tokens a micro-batch could hold now, with checkpointing where it is on or may go
        on (what every sequence must fit in), and the free bytes measured. Chooses nothing."""
        return self.measure(self.checkpointing or self.may_turn_on)

    def _choose(self) -> None:
        self.tokens, self.free = self.measure(self.checkpointing)
        where = f"{self.free / 2**30:.1f} GiB free" if self.free else "the fixed default"
        self.said.append(f"micro_batch_tokens auto -> {self.tokens} ({where})")
