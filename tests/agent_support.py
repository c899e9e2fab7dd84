"""What the agent tests share (tests/test_agents*.py): tiny Qwen2 checkpoints with the project's
byte-level tokenizer and a Hermes-style chat template of our own (tools, ``tool`` messages,
``<tool_call>`` JSON), as Qwen's instruct models write them.

`write_chat_tiny` is the random 64-wide model (`sampler_support.write_tiny`) with that template.
`write_letters_tiny` is the same model made to write lower-case letters: every token's
embedding carries a large component on one axis, and only the letters' output rows read it, so
whatever the context each step puts nearly all its mass on letters (a little on the rest, from
the random weights: log-probs still depend on the context). Letters decode and re-encode to the
same ids, so a conversation the agent sends back extends the tokens the model wrote, as a real
model's would; a random model writes bytes that are not UTF-8, which never round-trip.
"""

from __future__ import annotations

import json
import os

import torch

from sampler_support import write_tiny

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\nCall a tool as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>\\n\' -}}'
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + message['content'] -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{{- call['function']['arguments'] if call['function']['arguments'] is string "
    "else (call['function']['arguments'] | tojson) -}}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def write_chat_tiny(path: str) -> str:
    """`write_tiny` with `CHAT_TEMPLATE`, prompted through it (prompt style "chat")."""
    from transformers import AutoTokenizer

    from asyncrl.rl.model.policy import MARKER_FILE

    write_tiny(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump({"prompt_style": "chat", "max_new_tokens_hint": 16}, f)
    return path


def write_letters_tiny(path: str) -> str:
    """`write_chat_tiny`'s model made to write lower-case letters (see the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_chat_tiny(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    letters = tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        head = torch.nn.Parameter(embed.detach().clone())
        embed[:, 0] += 30.0  # every token: the residual stream's axis 0 dominates, positive
        head[letters, 0] += 2.0  # only letters read it
        model.lm_head.weight = head
    model.save_pretrained(path)
    return path
