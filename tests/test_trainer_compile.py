"""``--trainer.compile`` (``trainer/compile.py``): when it is on, what it compiles, and what it
refuses. Compiling itself is measured on the GPU (docs/trainer.md): on this CPU it takes a minute
or more for nothing, so no test here pays for it."""

from __future__ import annotations

import pytest
import torch

from asyncrl.rl.config.trainer import LoRAConfig, TrainerConfig
from asyncrl.rl.model.lora import attach_adapter
from asyncrl.rl.trainer.compile import CompileError, compiled, decoder_layers, eager


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
