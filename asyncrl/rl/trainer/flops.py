"""How much of its device a train step used: model FLOPs utilisation (MFU) and peak memory.

MFU counts the FLOPs the model needs (a recomputed forward under activation checkpointing is not
counted, as in PaLM's definition, appendix B) over the step's wall time and the device's dense
bf16 peak. Per token of a sequence of ``s`` tokens, with ``N`` the decoder layers' parameters:
``2N`` forward, ``2N`` for the activations' gradients and, when the weights train, ``2N`` for
theirs (a frozen LoRA base skips those; the adapters' own are negligible). Attention adds
``2 x 2 x s x H`` per layer and token forward (scores and values, half of it under a causal mask:
``2sH`` counted), three times that for forward and backward. The output layer runs only on the
scored (completion) tokens (``scoring/logprobs.py``): ``6VH`` each, ``4VH`` when frozen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncrl.rl.rollout import RolloutGroup

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}
"""Dense bf16 tensor-core peaks (the vendors' datasheets, SXM parts), by a word in the device's name."""


def peak_flops(device: torch.device) -> float:
    """The device's dense bf16 peak in FLOP/s, 0 when it is not known (then no MFU is reported)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((peak for word, peak in PEAK_BF16_FLOPS.items() if word in name), 0.0)


def step_flops(config, body: int, groups: list[RolloutGroup], *, weights_train: bool) -> float:
    """Model FLOPs of one train step over ``groups`` (see the module docstring) for a model of
    transformers ``config`` whose decoder layers hold ``body`` parameters (`decoder_parameters`)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    per_param = 6 if weights_train else 4
    flops = 0.0
    for g in groups:
        for completion in g.completion_ids:
            s = len(g.prompt_ids) + len(completion)
            flops += per_param * body * s + 3 * 2 * 2 * s * s / 2 * hidden * layers
            flops += per_param * vocab * hidden * len(completion)
    return flops


def decoder_parameters(model: PreTrainedModel) -> int:
    """Parameters of the decoder's layers: not the embedding table (a lookup) nor the output layer
    (counted per scored token). LoRA adapters are counted in: a rounding error."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    untied = head is not None and head.weight is not embed
    return sum(p.numel() for p in model.parameters()) - embed.numel() - (head.weight.numel() if untied else 0)
