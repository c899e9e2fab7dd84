"""The default policy, made locally: a small Qwen2-architecture model with a byte-level
tokenizer (one token per ASCII character), warm-started by supervised training on Countdown reference solutions so that GRPO starts
from a policy that solves some held-out problems but far from all.

No hub and no internet: the tokenizer is Qwen2's byte-level BPE pipeline with the 256 byte symbols
and no merges, built with ``tokenizers``; the model comes from a ``Qwen2Config``. The result is an
ordinary HF checkpoint directory (safetensors weights, tokenizer files, and a chat template that
renders the very prompt the model was trained on: a user message ``"3 7 25 50 -> 178"`` becomes
``"3 7 25 50 -> 178:"``) plus ``asyncrl_model.json``, which records the prompt style the model was
trained on. It is cached under a hash of everything that determines it, and written to a
temporary directory that is renamed into place only when complete: a crash mid-write leaves a
``.tmp-*`` directory that is never read, and is removed by a later build once its writer is gone.

Any other local HF checkpoint directory can be named instead: :func:`load_policy` then uses the
checkpoint's own tokenizer and chat template around :func:`countdown.format_prompt`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AsyncrlError
from ..runtime.transport import pid_alive
from .countdown import (
    CountdownConfig,
    CountdownProblem,
    format_prompt,
    format_prompt_compact,
    format_reference,
    score,
    train_and_heldout,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# transformers is imported inside the functions that need it: it takes seconds to import, and
# code that only reads the configs here (CLI --help, config dumps) should not pay for it.

MARKER_FILE = "asyncrl_model.json"
"""Written last into a checkpoint we build: records the prompt style and how the model was made."""
PROMPT_STYLES = ("compact", "chat", "plain")
"""compact: :func:`format_prompt_compact`, no template (our char-level model). chat: the
tokenizer's chat template around :func:`format_prompt`. plain: :func:`format_prompt` and a newline,
for checkpoints without a chat template."""
CHAT_MAX_NEW_TOKENS = 256
"""Generation budget hinted for checkpoints we did not train: they may write more than the answer."""

_TRAIN_THREADS = 1
"""Intra-op threads of the warm start's training: fixed, so the weights do not depend on the machine."""

# Bump when the tokenizer, data or training code changes what a cached checkpoint would contain.
_FORMAT_VERSION = 1

# --- configuration --------------------------------------------------------------------------------


from .sections import ModelConfig, WarmStartConfig  # noqa: E402  (torch-free: CLI --help and flag errors)

class WarmStartStopped(AsyncrlError):
    """The warm start was stopped (its ``stop`` event set) before it finished; nothing was cached."""


class PolicyLoadError(AsyncrlError):
    """A checkpoint directory is missing, incomplete, or names a prompt style we do not know."""

    def __init__(self, path: str, message: str):
        super().__init__(f"policy checkpoint {path!r}: {message}")
        self.path = path


# --- tokenizer ------------------------------------------------------------------------------------

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
# Qwen2's pre-tokenizer split; with no merges every byte is a token whatever the split, but keeping
# Qwen2's exact pipeline means transformers' Qwen2Tokenizer, which AutoTokenizer rebuilds from
# vocab + merges for any model_type "qwen2" checkpoint, is the very same tokenizer.
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_TOKENIZER_SPEC = {"specials": [PAD, EOS, IM_START], "tags": _TAGS, "chat_template": _CHAT_TEMPLATE,
                   "split": _QWEN2_SPLIT, "model": "byte-level BPE without merges"}


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (what ByteLevel pre-tokenization emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def build_tokenizer():
    """A byte-level tokenizer without merges, so one token per byte (per character, for ASCII):
    Qwen2's tokenizer pipeline with a 256-symbol vocabulary, plus the chat specials, the answer
    tags and a chat template that renders the compact prompt the model is trained on. Every
    string round-trips; saves and loads like any HF tokenizer, and loads back identically through
    ``AutoTokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: i for i, sym in enumerate([PAD, EOS, IM_START, *_byte_symbols()])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=PAD,
                                  additional_special_tokens=[IM_START], clean_up_tokenization_spaces=False)
    tok.add_tokens(_TAGS)
    tok.chat_template = _CHAT_TEMPLATE
    return tok


# --- prompt format --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PromptFormat:
    """How a policy is prompted, and when its completion ends."""

    style: str
    """One of PROMPT_STYLES."""
    tokenizer: object
    """The policy's ``PreTrainedTokenizerBase``."""
    stop_token_ids: list[int]
    """Generation ends at any of these (eos, end-of-turn); they are part of the completion."""
    max_new_tokens_hint: int
    """Enough new tokens for a complete answer from this policy."""

    def __post_init__(self) -> None:
        if self.style not in PROMPT_STYLES:
            raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, not {self.style!r}")

    def prompt_text(self, problem: CountdownProblem) -> str:
        """The prompt as text; its last character is the one before the completion's first."""
        if self.style == "compact":
            return format_prompt_compact(problem)
        if self.style == "plain":
            return format_prompt(problem) + "\n"
        messages = [{"role": "user", "content": format_prompt(problem)}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, problem: CountdownProblem) -> list[int]:
        """Token ids of the full prompt, as the model should see it before its completion."""
        # A chat template writes its own BOS where the model wants one; add_special_tokens would
        # add a second. Plain text gets the tokenizer's usual specials.
        specials = self.style == "plain"
        return list(self.tokenizer(self.prompt_text(problem), add_special_tokens=specials)["input_ids"])


def _stop_token_ids(generation_eos: Any, tokenizer) -> list[int]:
    """The generation config's end-of-sequence id(s) (an id, a list, or None), then the tokenizer's."""
    ids: list[int] = []
    for value in (generation_eos, tokenizer.eos_token_id):
        for i in (value if isinstance(value, (list, tuple)) else [value]):
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
    return tokenizer, PromptFormat(style, tokenizer, _stop_token_ids(eos, tokenizer), hint)


def load_policy(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
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
    stops = _stop_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer)
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


# --- the cached default ---------------------------------------------------------------------------


def cache_root(cache_dir: str | None = None) -> str:
    """``cache_dir``, else ``$ASYNCRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncrl`` (``~/.cache``)."""
    if cache_dir:
        return cache_dir
    if os.environ.get("ASYNCRL_CACHE_DIR"):
        return os.environ["ASYNCRL_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "asyncrl")


def cache_key(model: ModelConfig, warm: WarmStartConfig, countdown: CountdownConfig) -> str:
    """Hash of everything that determines the default checkpoint. A probe prompt and reference are
    hashed too, so a change to their formats invalidates the cache without a version bump."""
    probe = CountdownProblem(numbers=[3, 7, 25], target=46, solution="25 + 7 * 3")
    spec = {"version": _FORMAT_VERSION, "model": asdict(model), "warm": asdict(warm),
            "countdown": asdict(countdown), "tokenizer": _TOKENIZER_SPEC,
            "probe": [format_prompt_compact(probe), format_reference(probe)]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def default_model(model: ModelConfig = ModelConfig(), warm: WarmStartConfig = WarmStartConfig(),
                  countdown: CountdownConfig = CountdownConfig(), *, cache_dir: str | None = None,
                  threads: int | None = None, log: Callable[[str], object] = print,
                  stop: threading.Event | None = None) -> str:
    """Path of the embedded policy's checkpoint directory, built and warm-started on first use.

    Cached at ``<cache_root>/models/<cache_key>``. Only a complete directory ever has that name: it
    is written under a temporary name and renamed, so a second call (even after a crash of the
    first) either finds a whole checkpoint or builds one afresh.

    The training itself always runs on one torch thread, so the weights cached under a key are the
    same on any machine (of one CPU kind) whatever its core count; see ``_build``.

    ``threads``: torch intra-op threads of the greedy evaluation after training (it changes no
    weights); None: the cores this process may run on (its CPU affinity), at most 4. Not a load
    reading: one taken just after a burst (pip) picked 1 thread on an idle machine. On cores that
    other busy processes share, pass 1: OpenMP threads waiting at each barrier for a descheduled
    sibling cost more than they bring (2 threads ran 1.7x to 6x slower than 1 on 2 loaded cores).

    ``stop``: once set, the build stops within a training step (or a data / evaluation chunk) and
    raises WarmStartStopped, leaving nothing in the cache. For a caller that runs this in a worker
    thread (``asyncio.to_thread``) and is cancelled: a thread cannot be killed, and asyncio's
    shutdown waits for it.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1 or None, not {threads}")
    models_dir = os.path.join(cache_root(cache_dir), "models")
    key = cache_key(model, warm, countdown)
    final = os.path.join(models_dir, key)
    if _is_complete(final):
        log(f"[model] cached default policy {final}")
        return final
    os.makedirs(models_dir, exist_ok=True)
    _remove_orphans(models_dir, key, log)
    tmp = tempfile.mkdtemp(dir=models_dir, prefix=f".tmp-{key}-{os.getpid()}-")
    try:
        _build(tmp, model, warm, countdown, threads, log, stop)
        _publish(tmp, final, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    return final


def _is_complete(path: str) -> bool:
    # The marker is written last, and the directory renamed after it: its presence means complete.
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def _publish(tmp: str, final: str, log: Callable[[str], object]) -> None:
    if os.path.isdir(final) and not _is_complete(final):
        log(f"[model] replacing incomplete {final}")  # not ours (we rename whole dirs); never reuse it
        shutil.rmtree(final)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):  # not a concurrent builder winning the race: a real failure
            raise
        log(f"[model] another process built {final} first; using it")


def _remove_orphans(models_dir: str, key: str, log: Callable[[str], object]) -> None:
    """Temporary directories of crashed builders of ``key`` (their pid is gone)."""
    prefix = f".tmp-{key}-"
    for name in os.listdir(models_dir):
        pid = name[len(prefix):].split("-")[0] if name.startswith(prefix) else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            log(f"[model] removing partial build {name}")
            shutil.rmtree(os.path.join(models_dir, name), ignore_errors=True)


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise WarmStartStopped("the warm start of the default model was stopped before it finished")


def _build(out: str, model_cfg: ModelConfig, warm: WarmStartConfig, countdown: CountdownConfig,
           threads: int | None, log: Callable[[str], object], stop: threading.Event | None = None) -> None:
    tokenizer = build_tokenizer()
    _check_stop(stop)
    train, heldout = train_and_heldout(warm.data_seed, warm.n_examples, warm.heldout_reserve, countdown)
    _check_stop(stop)
    ids, labels, lengths, longest_completion = _encode(tokenizer, train, model_cfg.max_positions, stop)
    # Training runs on one intra-op thread whatever ``threads`` says, so that the weights cached
    # under a key do not depend on the machine's core count (the key does not name it). With more
    # threads, torch splits elementwise kernels (SiLU) into per-thread chunks whose ends need not
    # fall on the vector width, and the tail is computed differently: on 3 threads one SiLU output
    # was 4e-9 off at the third step, and 48 of 50 tensors differed after 30 (2 threads happened to
    # agree with 1 bit for bit over all 400 steps, 4 over 30: sizes that split evenly). Cost, 2 cores, default
    # config: ~275 ms a step on one thread against ~150 ms on two when idle (400 steps: ~110 s
    # against ~60 s, once per cache key); under load two threads were slower (545 against 930 ms).
    with _torch_threads(_TRAIN_THREADS):
        torch.manual_seed(warm.seed)
        model = _new_model(model_cfg, tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"[model] warm-starting {n_params / 1e6:.2f}M-parameter Qwen2 on {len(train)} problems, "
            f"{warm.steps} steps of {warm.batch_size}, on one thread (the same weights on any machine)")
        start = time.monotonic()
        loss = _train(model, ids, labels, lengths, warm, log, stop)
        wall_s = time.monotonic() - start
    with _torch_threads(threads or _usable_cores()):  # the evaluation changes no weights
        hint = longest_completion + 8  # slack: a sampled answer may be a little longer than any reference
        fmt = PromptFormat("compact", tokenizer, _stop_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer), hint)
        greedy = (solve_rate(model, tokenizer, fmt, heldout[:warm.eval_problems], stop=stop)
                  if warm.eval_problems else None)
    # The solve rate goes to the marker file only: a GRPO run prints its own held-out number before
    # training (on its n_heldout problems), and two different "held-out" figures read as a conflict.
    log(f"[model] warm start done in {wall_s:.0f} s, final loss {loss:.3f}")
    _check_stop(stop)
    _save(out, model, tokenizer, {
        "prompt_style": "compact", "max_new_tokens_hint": hint, "format_version": _FORMAT_VERSION,
        "parameters": n_params, "warm_start_wall_s": round(wall_s, 1), "final_loss": round(loss, 4),
        "heldout_greedy_solve_rate": greedy, "model": asdict(model_cfg), "warm": asdict(warm),
        "countdown": asdict(countdown)})


def _save(out: str, model, tokenizer, marker: dict) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, MARKER_FILE), "w") as f:  # last: its presence marks a whole checkpoint
        json.dump(marker, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _new_model(cfg: ModelConfig, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_positions,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, use_sliding_window=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """``threads`` intra-op threads inside the block, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _usable_cores(most: int = 4) -> int:
    """The cores this process may run on (its CPU affinity, else the machine's), at most ``most``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(most, cores))


# --- warm start -----------------------------------------------------------------------------------


def _encode(tokenizer, problems: Sequence[CountdownProblem], max_positions: int,
            stop: threading.Event | None = None):
    """Right-padded ``ids``, ``labels`` (-100 on prompt and padding) and lengths of
    compact prompt + reference completion + eos for every problem, and the longest completion."""
    rows = []
    for i, p in enumerate(problems):
        if i % 1000 == 0:  # 20 000 problems take seconds
            _check_stop(stop)
        prompt = tokenizer(format_prompt_compact(p), add_special_tokens=False)["input_ids"]
        completion = tokenizer(format_reference(p), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, completion))
    longest = max(len(a) + len(b) for a, b in rows)
    if longest > max_positions:
        raise ValueError(f"a training sequence has {longest} tokens, more than max_positions={max_positions}; "
                         "raise ModelConfig.max_positions or narrow the CountdownConfig")
    ids = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    lengths = torch.empty(len(rows), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        labels[i, len(prompt):n] = torch.tensor(completion)
        lengths[i] = n
    return ids, labels, lengths, max(len(completion) for _, completion in rows)


def _lr_factor(step: int, warm: WarmStartConfig) -> float:
    if step < warm.warmup_steps:
        return (step + 1) / warm.warmup_steps
    progress = (step - warm.warmup_steps) / max(1, warm.steps - warm.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _train(model, ids, labels, lengths, warm: WarmStartConfig, log: Callable[[str], object],
           stop: threading.Event | None = None) -> float:
    """Next-token cross-entropy on the completions; returns the mean loss of the last 20 steps."""
    model.train()
    device = next(model.parameters()).device
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": warm.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=warm.lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, warm))
    gen = torch.Generator().manual_seed(warm.seed)
    order, cursor, recent = torch.randperm(len(ids), generator=gen), 0, []
    start = time.monotonic()
    for step in range(warm.steps):
        _check_stop(stop)
        if cursor + warm.batch_size > len(order):  # a fresh permutation per epoch
            order, cursor = torch.randperm(len(ids), generator=gen), 0
        batch = order[cursor:cursor + warm.batch_size]
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
            log(f"[model] step {step + 1}/{warm.steps} loss {sum(recent) / len(recent):.3f} "
                f"({time.monotonic() - start:.0f} s)")
    model.eval()
    return sum(recent) / len(recent)


# --- evaluation -----------------------------------------------------------------------------------


@torch.no_grad()
def solve_rate(model, tokenizer, fmt: PromptFormat, problems: Sequence[CountdownProblem], *, greedy: bool = True,
               n: int = 1, max_new_tokens: int | None = None, batch_size: int = 64, temperature: float = 1.0,
               stop: threading.Event | None = None) -> float:
    """Fraction of ``n`` completions per problem that :func:`countdown.score` finds correct.

    Batched, left-padded ``model.generate``; greedy decoding, or pure sampling at ``temperature``
    (no top-k / top-p: the distribution GRPO samples from). ``stop``: checked before each batch;
    once set, raises WarmStartStopped.
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, not {n} and {batch_size}")
    if greedy and n > 1:
        raise ValueError("greedy decoding gives the same completion n times; use n=1 or greedy=False")
    if not problems:
        return 0.0
    jobs = [p for p in problems for _ in range(n)]
    correct = 0
    for i in range(0, len(jobs), batch_size):
        _check_stop(stop)
        chunk = jobs[i:i + batch_size]
        texts = _generate(model, tokenizer, fmt, chunk, greedy, max_new_tokens or fmt.max_new_tokens_hint, temperature)
        correct += sum(score(p, t).correct for p, t in zip(chunk, texts))
    return correct / len(jobs)


def _generate(model, tokenizer, fmt: PromptFormat, problems: Sequence[CountdownProblem], greedy: bool,
              max_new_tokens: int, temperature: float) -> list[str]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fmt.stop_token_ids[0]
    prompts = [fmt.prompt_ids(p) for p in problems]
    width = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every completion starts at column `width`
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=not greedy,
                         max_new_tokens=max_new_tokens, eos_token_id=fmt.stop_token_ids, pad_token_id=pad,
                         **sampling)
    texts = []
    for row in out[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in fmt.stop_token_ids), len(row))
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return texts
