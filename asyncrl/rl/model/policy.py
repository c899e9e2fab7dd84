"""Loading a policy from a local Hugging Face checkpoint directory, with the prompt format it expects.

A directory built by the warm start (``model/warm_start.py``) carries ``asyncrl_model.json``
(MARKER_FILE) naming its prompt style; any other checkpoint is prompted through its own chat
template around the task's prompt, or as plain text if it has none.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.errors import AsyncrlError
from asyncrl.rl.tasks.base import Message, Prompt, Reply

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# transformers is imported inside the functions that need it: it takes seconds to import, and
# code that only reads the configs here (CLI --help, config dumps) should not pay for it.

MARKER_FILE = "asyncrl_model.json"
"""Written last into a checkpoint we build: records the prompt style and how the model was made."""
PROMPT_STYLES = ("compact", "chat", "plain")
"""compact: the task's compact form (`Prompt.compact`), no template (our char-level model). chat:
the tokenizer's chat template around the prompt's messages. plain: the messages as text
(`Prompt.text`) and a newline, for checkpoints without a chat template."""
CHAT_MAX_NEW_TOKENS = 256
"""Generation budget hinted for checkpoints we did not train: they may write more than the answer."""


class PolicyLoadError(AsyncrlError):
    """A checkpoint directory is missing, incomplete, or names a prompt style we do not know."""

    def __init__(self, path: str, message: str):
        super().__init__(f"policy checkpoint {path!r}: {message}")
        self.path = path


class PromptStyleError(AsyncrlError, ValueError):
    """A task's prompt has no form that the policy's prompt style can render."""


# --- prompt format --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PromptFormat:
    """How a policy is prompted, and when its completion ends."""

    style: str
    """One of PROMPT_STYLES."""
    tokenizer: PreTrainedTokenizerBase
    """The policy's tokenizer."""
    stop_token_ids: list[int]
    """Generation ends at any of these (eos, end-of-turn); they are part of the completion."""
    max_new_tokens_hint: int
    """Enough new tokens for a complete answer from this policy."""

    def __post_init__(self) -> None:
        if self.style not in PROMPT_STYLES:
            raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, not {self.style!r}")

    def render_text(self, prompt: Prompt) -> str:
        """A task's prompt as this policy reads it; its last character is the one before the
        completion's first."""
        if self.style == "compact":
            if not prompt.compact:
                raise PromptStyleError(
                    "this policy reads the compact prompt style, and the task's prompt has no "
                    "compact form: use a checkpoint with a chat template"
                )
            return prompt.compact
        if self.style == "plain":
            return prompt.text + "\n"
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def render_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of the full prompt, as the model should see it before its completion."""
        # A chat template writes its own BOS where the model wants one; add_special_tokens would
        # add a second. Plain text gets the tokenizer's usual specials.
        specials = self.style == "plain"
        return list(self.tokenizer(self.render_text(prompt), add_special_tokens=specials)["input_ids"])

    def reply_ids(self, prompt: Prompt, turns: list[Message], reply: Reply, model_stopped_on_token: bool) -> list[int]:
        """The tokens that follow a model turn so that the next one starts right: an environment's
        ``reply`` to the last of ``turns`` (the model's, ``assistant``) in the conversation that
        began with ``prompt``. compact and plain: ``reply.text`` as is. chat: what the chat template
        writes from the end of the model's turn to the start of the next one: the rest of the
        turn's closing (after the stop token the model ended on, e.g. Qwen's "\n" after
        <|im_end|>; all of it when the turn was cut by a stop string or by length), the reply as a
        ``reply.role`` message, and the generation prompt."""
        if self.style != "chat":
            return self._ids(reply.text)
        history = [*prompt.messages, *turns]
        if not history or history[-1].role != "assistant":
            raise PromptStyleError("reply_ids: the last turn must be the model's (assistant)")
        base = self._chat(history, generation_prompt=False)
        full = self._chat([*history, Message(reply.role, reply.text)], generation_prompt=True)
        if not full.startswith(base):
            raise PromptStyleError(
                "this chat template renders the conversation differently once a reply follows "
                "it, so a reply cannot be appended to the tokens the model wrote: multi-turn "
                "episodes need a template whose renderings extend each other"
            )
        return self._ids(self._closing(history, model_stopped_on_token) + full[len(base) :])

    def _closing(self, history: list[Message], model_stopped_on_token: bool) -> str:
        """What the template writes after an assistant turn's content (found with a marker as the
        content, as templates may rewrite the content itself); without the stop token the model
        already wrote, when its turn ended on one."""
        marker = "\x00asyncrl-end-of-content\x00"
        rendered = self._chat([*history[:-1], Message("assistant", marker)], generation_prompt=False)
        closing = rendered[rendered.rfind(marker) + len(marker) :] if marker in rendered else ""
        if model_stopped_on_token:
            for token in self.tokenizer.convert_ids_to_tokens(list(self.stop_token_ids)):
                if token and closing.startswith(token):
                    return closing[len(token) :]
        return closing

    def _chat(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _ids(self, text: str) -> list[int]:
        # Without the tokenizer's specials: a BOS in the middle of the context would be wrong.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def stop_token_ids(generation_eos: Any, tokenizer) -> list[int]:
    """The generation config's end-of-sequence id(s) (an id, a list, or None), then the tokenizer's."""
    ids: list[int] = []
    for value in (generation_eos, tokenizer.eos_token_id):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _prompt_style(path: str, tokenizer) -> tuple[str, int]:
    """``(style, max_new_tokens hint)``: from our marker file, else the chat template if any."""
    marker = _read_marker(path)
    if marker is None:
        return ("chat" if tokenizer.chat_template else "plain"), CHAT_MAX_NEW_TOKENS
    style, hint = marker.get("prompt_style"), marker.get("max_new_tokens_hint", CHAT_MAX_NEW_TOKENS)
    if style not in PROMPT_STYLES:
        raise PolicyLoadError(path, f"{MARKER_FILE} names prompt style {style!r}, not one of {PROMPT_STYLES}")
    return style, int(hint)


def load_prompt_format(path: str) -> tuple[PreTrainedTokenizerBase, PromptFormat]:
    """``(tokenizer, PromptFormat)`` of a local checkpoint, as `load_policy` makes them, without
    loading the model (for a backend whose engine loads it in a process of its own)."""
    from transformers import AutoTokenizer, GenerationConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PolicyLoadError(path, "no config.json: not a HF checkpoint directory")
    _read_marker(path)  # an unreadable marker fails before the tokenizer loads
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    style, hint = _prompt_style(path, tokenizer)
    eos = None
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    return tokenizer, PromptFormat(style, tokenizer, stop_token_ids(eos, tokenizer), hint)


def load_policy(
    path: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, PromptFormat]:
    """``(model, tokenizer, PromptFormat)`` of a local HF checkpoint directory, in eval mode.

    A directory we built carries ``asyncrl_model.json`` with its prompt style; any other uses its
    chat template (style "chat"), or plain text if it has none. Raises PolicyLoadError if ``path``
    is not a checkpoint directory or its marker file is unreadable.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PolicyLoadError(path, "no config.json: not a HF checkpoint directory")
    _read_marker(path)  # an unreadable marker fails before anything loads
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    style, hint = _prompt_style(path, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32)
    model.to(device).eval()
    stops = stop_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer)
    return model, tokenizer, PromptFormat(style, tokenizer, stops, hint)


def _read_marker(path: str) -> dict | None:
    file = os.path.join(path, MARKER_FILE)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise PolicyLoadError(path, f"unreadable {MARKER_FILE}: {e}") from e
    if not isinstance(marker, dict):
        raise PolicyLoadError(path, f"{MARKER_FILE} is not a JSON object")
    return marker
