"""``--trainer.compile`` (``trainer/compile.py``): when it is on, what it compiles, and what it
refuses; and that the training step's varied micro-batches compile the layers once, not again
mid-run. Compiling itself is measured on the GPU (docs/trainer.md): on this CPU it takes a minute
or more for nothing, so no test here pays for it (the graphs are counted by a backend that runs
them as traced)."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig
from asyncrl.rl.model.lora import attach_adapter
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scoring.batch import Sequence, padded_batch
from asyncrl.rl.scoring.forward import MIN_ROWS
from asyncrl.rl.scoring.logprobs import scored_logprobs
from asyncrl.rl.trainer.compile import CompileError, compile_layers, compiled, decoder_layers, eager
from asyncrl.rl.trainer.packing import packed_micro_batches


def test_auto_compiles_one_cuda_trainer_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not compiled(TrainerConfig(), cpu)
    assert compiled(TrainerConfig(), cuda)
    assert not compiled(TrainerConfig(world_size=2), cuda)  # not measured with FSDP2
    assert compiled(TrainerConfig(compile=True), cpu) and not compiled(TrainerConfig(compile=False), cuda)


def test_the_decoder_layers_of_a_causal_lm_and_of_its_lora_wrapper_are_found():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = AutoModelForCausalLM.from_config(config)
    assert list(decoder_layers(model)) == list(model.model.layers) and len(model.model.layers) == 3
    pytest.importorskip("peft")
    wrapped = attach_adapter(model, LoRAConfig(rank=2, target_modules=("q_proj",)))
    assert list(decoder_layers(wrapped)) == list(model.model.layers)


def test_a_model_without_decoder_layers_is_refused_naming_the_flag():
    with pytest.raises(CompileError, match="--trainer.compile false"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_eager_runs_a_compiled_module_without_compiling_it():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    class Layer(torch.nn.Module):  # a model's own layer class (dynamo skips torch.nn's)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return torch.relu(x @ self.weight)

    module = Layer()
    module.compile(backend=backend)
    x = torch.randn(2, 3)
    with eager():
        assert torch.equal(module(x), torch.relu(x @ module.weight))
    assert calls == []  # nothing traced under it
    module(x)
    assert len(calls) == 1
    with eager(False):  # off: compiled as usual (no new graph for the same shapes)
        module(x)
    assert len(calls) == 1


def tiny_policy(tmp_path):
    """A one-layer Qwen2 policy saved as a trainer loads it."""
    from asyncrl.rl.config.model import ModelConfig
    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.model.warm_start import new_model

    path = tmp_path / "start"
    tok = build_tokenizer()
    shape = ModelConfig(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=32)
    new_model(shape, tok).save_pretrained(path)
    tok.save_pretrained(path)
    (path / MARKER_FILE).write_text(json.dumps({"prompt_style": "compact", "max_new_tokens_hint": 20}))
    return str(path)


def grpo_batch(prompt_lengths: list[int], completion_lengths: list[list[int]]) -> list[RolloutGroup]:
    """Groups of the given prompt and completion lengths (token ids and rewards made up)."""
    return [
        RolloutGroup(
            p,
            [3 + (p + i) % 9 for i in range(n)],
            [[4 + (j + i) % 7 for i in range(c)] for j, c in enumerate(lengths)],
            [[-1.0] * c for c in lengths],
            [float(j % 2) for j in range(len(lengths))],
            version=0,
        )
        for p, (n, lengths) in enumerate(zip(prompt_lengths, completion_lengths))
    ]


@pytest.mark.parametrize("pack_tokens", [0, 48])
def test_the_layers_compile_once_whatever_the_micro_batches_of_a_grpo_run(tmp_path, monkeypatch, pack_tokens):
    """What made the layers recompile mid-run on a GPU (``scoring/forward.py``'s `layout_inputs`):
    a micro-batch without padding (transformers then gave the layers no mask) and one of one row
    (a size of 1 is specialised); here in steps after a first step of ordinary micro-batches. The
    layers compile once for each layout they meet (padded rows, no mask; packed rows, a 4-D mask):
    packed, the first step holds a sequence too long to share a row, which makes a padded
    micro-batch (`packed_micro_batches`), so both are met there."""
    from asyncrl.rl.trainer import actor, policy

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(policy, "compile_layers", lambda model: compile_layers(model, backend=backend))
    torch._dynamo.reset()  # the layer's code is shared: no graph of another test's
    try:
        trainer = actor.TrainerActor(
            tiny_policy(tmp_path), TrainerConfig(compile=True, micro_batch_tokens=96, pack_tokens=pack_tokens)
        )
        steps = [
            # rows of varied lengths, several micro-batches, the last one smaller
            grpo_batch([5, 9, 7], [[3, 12, 8, 20], [6, 6, 15, 2], [20, 1, 5, 3]])
            + (grpo_batch([8], [[50, 3]]) if pack_tokens else []),
            # every row the same length: a micro-batch without padding
            grpo_batch([6, 6], [[10, 10, 10], [10, 10, 10]]),
            # a sequence longer than half the budget: a micro-batch of one row
            grpo_batch([8, 4], [[50, 3, 5], [2, 7, 4]]),
        ]
        trainer.train_share(steps[0])
        first = len(graphs)
        assert first >= 1  # compiled at all
        for groups in steps[1:]:
            metrics = trainer.train_share(groups)
            assert metrics.micro_batches >= 1
        assert len(graphs) == first
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize(
    "rows, length",
    [(3, 32), (17, 17)],  # a length equal to the hidden size (and head dim), to the row count
)
def test_the_layers_compile_once_whatever_sizes_the_first_micro_batch_had(tmp_path, monkeypatch, rows, length):
    """Sizes equal at the first compile stay distinct (`_distinct_sizes`): a first micro-batch
    whose length equals another of its sizes compiles no second graph for the next micro-batches."""
    from asyncrl.rl.trainer import actor, policy

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(policy, "compile_layers", lambda model: compile_layers(model, backend=backend))
    torch._dynamo.reset()
    try:
        trainer = actor.TrainerActor(tiny_policy(tmp_path), TrainerConfig(compile=True, micro_batch_tokens=4096))
        assert trainer.model.config.hidden_size == 32
        trainer.train_share(grpo_batch([10] * rows, [[length - 10] for _ in range(rows)]))
        first = len(graphs)
        assert first >= 1
        trainer.train_share(grpo_batch([10, 10, 10], [[5, 17], [12, 30], [40, 3]]))
        assert len(graphs) == first
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_one_row_micro_batch_given_a_dummy_row_scores_the_same(tmp_path, attention, packed):
    """`MIN_ROWS`: the dummy row a compiled model's forward gets beside a micro-batch of one row
    changes none of its scores."""
    from asyncrl.rl.model.policy import load_policy

    model, _, _ = load_policy(tiny_policy(tmp_path), torch.device("cpu"), torch.float32)
    model.set_attn_implementation(attention)
    seqs = [([5, 6, 7], [8, 9, 4, 4]), ([3, 3], [5, 6])]
    if packed:  # both sequences in one row
        groups = [RolloutGroup(0, p, [c], [[-1.0] * len(c)], [1.0], version=0) for p, c in seqs]
        (batch,) = packed_micro_batches(groups, torch.zeros(2), 64, torch.device("cpu"), 32)
    else:
        batch = padded_batch([Sequence(*seqs[0])], torch.device("cpu"))
    assert len(batch.input_ids) == 1

    def scores_and_gradients(min_rows: int, fused: bool):
        setattr(model, MIN_ROWS, min_rows)
        model.zero_grad(set_to_none=True)
        scores, _ = scored_logprobs(model, batch, 1.0, fused=fused)
        scores[batch.mask].sum().backward()
        return scores.detach(), {n: p.grad for n, p in model.named_parameters()}

    for fused in (True, False):
        alone, grads = scores_and_gradients(1, fused)
        beside, grads_beside = scores_and_gradients(2, fused)
        torch.testing.assert_close(beside, alone)
        torch.testing.assert_close(grads_beside, grads)
        assert alone[batch.mask].abs().min() > 0  # the scored tokens were scored
