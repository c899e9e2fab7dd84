"""The default policy, made locally: a small Qwen2-architecture model with a byte-level
tokenizer (one token per ASCII character), warm-started by supervised training on Countdown reference solutions so that GRPO starts
from a policy that solves some held-out problems but far from all.

No hub and no internet: the tokenizer is Qwen2's byte-level BPE pipeline with the 256 byte symbols
and no merges, built with ``tokenizers``; the model comes from a ``Qwen2Config``. The result is an ordinary HF checkpoint directory (safetensors weights,
tokenizer files, chat template) plus ``asyncrl_model.json``, which records the prompt style the
model was trained on. It is cached under a hash of everything that determines it, and written to a
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

# Bump when the tokenizer, data or training code changes what a cached checkpoint would contain.
_FORMAT_VERSION = 1

# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the embedded Qwen2 model. The defaults (1.02M parameters) warm-start in about two
    minutes on one CPU core (122 s measured, 400 steps) and sample fast enough for GRPO there."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads; ``hidden_size / num_heads`` (head_dim) must be 32 or 64, which vLLM's CPU
    attention supports."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    intermediate_size: int = 512
    """Width of the SwiGLU MLP."""
    max_positions: int = 128
    """Longest prompt + completion, in tokens (characters, for the embedded tokenizer)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    tie_embeddings: bool = True
    """Share input embedding and output head (saves vocab_size * hidden_size parameters)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, not {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads not in (32, 64):
            raise ValueError(f"hidden_size / num_heads (head_dim) must be 32 or 64, not "
                             f"{self.hidden_size} / {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, not {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised warm start on reference solutions of the Countdown train split. The defaults aim
    at a held-out solve rate well inside (0, 1) so that GRPO has room to improve it."""

    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step."""
    lr: float = 2e-3
    """Peak learning rate (AdamW), reached after ``warmup_steps``, then cosine decay to lr / 10.
    Training escapes a loss plateau (~0.9, format learnt, arithmetic not) around step 150; at 3e-3
    and above, some seeds stay on it."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    n_examples: int = 20000
    """Distinct training problems (each seen ``steps * batch_size / n_examples`` times on average)."""
    seed: int = 0
    """Seed of the weight initialisation and the batch order."""
    data_seed: int | str = 0
    """Seed of :func:`countdown.train_and_heldout` whose train split is trained on. Use the same
    seed for GRPO's split: its first ``heldout_reserve`` held-out problems are never trained on."""
    heldout_reserve: int = 1000
    """Held-out problems excluded from training (the held-out stream is prefix-stable, so any
    held-out set of this size or smaller, from the same ``data_seed``, is unseen)."""
    eval_problems: int = 200
    """Held-out problems solved greedily after training, for the log and the marker file; 0 skips."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "n_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmStartConfig.{name} must be >= 1, not {getattr(self, name)}")
        for name in ("warmup_steps", "heldout_reserve", "eval_problems"):
            if getattr(self, name) < 0:
                raise ValueError(f"WarmStartConfig.{name} must be >= 0, not {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, not {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, not {self.weight_decay}")
        if self.eval_problems > self.heldout_reserve:
            raise ValueError(f"eval_problems ({self.eval_problems}) must be <= heldout_reserve "
                             f"({self.heldout_reserve}): only reserved problems are unseen")


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
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
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
    tags and a Qwen-style chat template. Every string round-trips; saves and loads like any HF
    tokenizer, and loads back identically through ``AutoTokenizer``."""
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
                  threads: int | None = None, log: Callable[[str], object] = print) -> str:
    """Path of the embedded policy's checkpoint directory, built and warm-started on first use.

    Cached at ``<cache_root>/models/<cache_key>``. Only a complete directory ever has that name: it
    is written under a temporary name and renamed, so a second call (even after a crash of the
    first) either finds a whole checkpoint or builds one afresh.

    ``threads``: torch intra-op threads while building; None picks the cores not already busy
    (cores minus the 1-minute load average), 1 to 4. Measured on 2 shared cores: 1 thread took 113 s
    where 2 took 292 s, as OpenMP threads waiting at each barrier for a descheduled sibling cost more
    than they bring; and a 1M-parameter model gains little beyond 4.
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
        _build(tmp, model, warm, countdown, threads, log)
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


def _build(out: str, model_cfg: ModelConfig, warm: WarmStartConfig, countdown: CountdownConfig,
           threads: int | None, log: Callable[[str], object]) -> None:
    tokenizer = build_tokenizer()
    train, heldout = train_and_heldout(warm.data_seed, warm.n_examples, warm.heldout_reserve, countdown)
    ids, labels, lengths, longest_completion = _encode(tokenizer, train, model_cfg.max_positions)
    with _torch_threads(threads):
        torch.manual_seed(warm.seed)
        model = _new_model(model_cfg, tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"[model] warm-starting {n_params / 1e6:.2f}M-parameter Qwen2 on {len(train)} problems, "
            f"{warm.steps} steps of {warm.batch_size}, {torch.get_num_threads()} threads")
        start = time.monotonic()
        loss = _train(model, ids, labels, lengths, warm, log)
        wall_s = time.monotonic() - start
        hint = longest_completion + 8  # slack: a sampled answer may be a little longer than any reference
        fmt = PromptFormat("compact", tokenizer, _stop_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer), hint)
        greedy = solve_rate(model, tokenizer, fmt, heldout[:warm.eval_problems]) if warm.eval_problems else None
    log(f"[model] warm start done in {wall_s:.0f} s, final loss {loss:.3f}"
        + (f", held-out greedy solve rate {greedy:.1%}" if greedy is not None else ""))
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
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Intra-op threads for the warm start (see default_model), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or _idle_cores())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _idle_cores(most: int = 4) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(most, cores - busy))


# --- warm start -----------------------------------------------------------------------------------


def _encode(tokenizer, problems: Sequence[CountdownProblem], max_positions: int):
    """Right-padded ``ids``, ``labels`` (-100 on prompt and padding) and lengths of
    compact prompt + reference completion + eos for every problem, and the longest completion."""
    rows = []
    for p in problems:
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


def _train(model, ids, labels, lengths, warm: WarmStartConfig, log: Callable[[str], object]) -> float:
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
               n: int = 1, max_new_tokens: int | None = None, batch_size: int = 64, temperature: float = 1.0) -> float:
    """Fraction of ``n`` completions per problem that :func:`countdown.score` finds correct.

    Batched, left-padded ``model.generate``; greedy decoding, or pure sampling at ``temperature``
    (no top-k / top-p: the distribution GRPO samples from).
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
