"""The embedded model's tokenizer: Qwen2's byte-level pipeline with 256 byte symbols and no merges
(one token per ASCII character), the chat specials, the answer tags as whole tokens, and a chat
template that renders the compact prompt the model is trained on. No hub, no internet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from asyncrl.rl.agents.chat import COMPACT_CALLS

PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
# Whole-token tags: the answer markers are 17 characters of every completion, so as single
# tokens they shorten sequences by a third. Ordinary (not special) tokens: decode keeps them.
_TAGS = ["<answer>", "</answer>"]
# The chat template renders exactly what the warm start trains on (the "compact" prompt style), so
# that transformers' apply_chat_template and vLLM's chat prompt the model as it was trained: a
# Qwen-style "<|im_start|>user..." prompt is text it has never seen, and it answers it with junk.
# The user message is the numbers and the target, "3 7 25 50 -> 178" (a trailing ":" and outer
# whitespace are tolerated); the generation prompt is the ":" after which the answer starts; an
# assistant message after it renders as the completion the model learnt, answer then eos.
_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' and loop.first -%}"
    "{%- set content = message['content'] | trim -%}"
    "{{- content[:-1] if content.endswith(':') else content -}}"
    "{%- elif message['role'] == 'assistant' and loop.index == 2 -%}"
    "{{- ':' + message['content'] + eos_token -}}"
    "{%- else -%}"
    "{{- raise_exception('this model was trained on one prompt form: a single user message with the "
    "numbers and the target, e.g. \\'3 7 25 50 -> 178\\', optionally followed by its assistant answer') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ':' -}}{%- endif -%}"
)


def compact_chat_template(stops: Sequence[str] = ()) -> str:
    """The chat template of a model warm-started on a task other than Countdown: it renders a
    conversation exactly as the warm start and the episodes lay it out in the compact style, every
    message's content verbatim (the first user message is the task's prompt as a string, or its
    `Prompt.compact`), each assistant message followed by eos unless it ends on one of ``stops``
    (the environment's stop strings, where a turn ends without one). The generation prompt adds
    nothing: the model's text follows the prompt's last character."""
    ends = ", ".join(json.dumps(s) for s in stops)  # a JSON string is a valid Jinja string literal
    no_eos = f"message['content'].endswith(({ends},))" if stops else "false"
    return (
        "{%- for message in messages -%}"
        "{{- message['content'] -}}"
        f"{{%- if message['role'] == 'assistant' and not {no_eos} -%}}{{{{- eos_token -}}}}{{%- endif -%}}"
        "{%- endfor -%}"
    )


AGENT_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Whole tokens of a model warm-started for an agent: the tool-call markers (Hermes / Qwen's, the
ones the endpoint reads tool calls by) and the tool-result ones around them, which at one token a
character would take 54 of every tool turn's tokens."""


def agent_chat_template() -> str:
    """The chat template of a model warm-started for an agent (`Agent` task): OpenAI messages in the
    compact style, every ``system``, ``developer`` and ``user`` content verbatim; an assistant
    message's content then each of its tool calls in the compact form (`asyncrl.rl.agents.chat.compact_calls`) and eos;
    a ``tool`` message's content inside ``<tool_response>...</tool_response>``. The generation
    prompt adds nothing, and ``tools`` are not written: the model knows its tools from its
    demonstrations only (a model that reads tool descriptions takes ``--model_path``).

    A call is ``<tool_call>NAME KEY=VALUE</tool_call>`` when its arguments are one string (an
    identifier for a key, a value with no outer whitespace and no ``</tool_call>``), else
    ``<tool_call>NAME ARGUMENTS</tool_call>`` with the arguments as JSON. Hermes's
    ``<tool_call>{"name": NAME, "arguments": {KEY: VALUE}}</tool_call>`` takes 34 more tokens of
    this tokenizer (one a character) for a one-argument call, on a model of 128 positions: the
    calculator agent's call for a product is 32 tokens in this form, 64 in Hermes's (docs/agents.md has
    what that did to learning). The endpoint reads this form back
    (`asyncrl.rl.agents.chat.parse_tool_calls`) for a template with the `COMPACT_CALLS` mark only."""
    return (
        COMPACT_CALLS + "{%- for message in messages -%}"
        "{%- if message['role'] == 'assistant' -%}"
        "{{- message['content'] -}}"
        "{%- for call in message.get('tool_calls') or [] -%}"
        "{%- set args = call['function']['arguments'] -%}"
        "{%- set one = (args.items() | list | first) if args is mapping and args | length == 1 else none -%}"
        "{%- if one and one[0].isidentifier() and one[1] is string and one[1] == one[1] | trim"
        " and '</tool_call>' not in one[1] -%}"
        "{{- '<tool_call>' + call['function']['name'] + ' ' + one[0] + '=' + one[1] + '</tool_call>' -}}"
        "{%- else -%}"
        "{{- '<tool_call>' + call['function']['name'] + ' ' + (args | tojson) + '</tool_call>' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{{- eos_token -}}"
        "{%- elif message['role'] == 'tool' -%}"
        "{{- '<tool_response>' + message['content'] + '</tool_response>' -}}"
        "{%- else -%}"
        "{{- message['content'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


# Qwen2's pre-tokenizer split; with no merges every byte is a token whatever the split, but keeping
# Qwen2's exact pipeline means transformers' Qwen2Tokenizer, which AutoTokenizer rebuilds from
# vocab + merges for any model_type "qwen2" checkpoint, is the very same tokenizer.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TOKENIZER_SPEC = {
    "specials": [PAD, EOS, IM_START],
    "tags": _TAGS,
    "chat_template": _CHAT_TEMPLATE,
    "split": _QWEN2_SPLIT,
    "model": "byte-level BPE without merges",
}


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (what ByteLevel pre-tokenization emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def build_tokenizer(tags: Sequence[str] = ()):
    """A byte-level tokenizer without merges, so one token per byte (per character, for ASCII):
    Qwen2's tokenizer pipeline with a 256-symbol vocabulary, plus the chat specials, the answer
    tags (and ``tags``, whole tokens after them) and a chat template that renders the compact
    prompt the model is trained on. Every string round-trips; saves and loads like any HF
    tokenizer, and loads back identically through ``AutoTokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: i for i, sym in enumerate([PAD, EOS, IM_START, *_byte_symbols()])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=PAD,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens([*_TAGS, *tags])
    tok.chat_template = _CHAT_TEMPLATE
    return tok
