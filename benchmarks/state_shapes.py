"""The state dicts of the weight-sync benchmarks: Qwen2 shapes by name, torch-free.

Shared by ``weight_sync.py`` and the receiver that ``slow_link.py`` starts in its network namespace,
which runs without the rest of ``weight_sync.py``.
"""

from __future__ import annotations

# name: (vocab, hidden, intermediate, layers, heads, kv_heads), untied lm_head as in a state dict
SHAPES = {
    "tiny": (1000, 64, 256, 2, 4, 2),
    "0.5b": (151936, 896, 4864, 24, 14, 2),  # Qwen2-0.5B: 1.17 GiB in bf16
    "7b": (152064, 3584, 18944, 28, 28, 4),  # Qwen2-7B: 14.2 GiB in bf16
}


def qwen2_state_shapes(
    vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int
) -> dict[str, tuple[int, ...]]:
    kv = hidden // heads * kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
