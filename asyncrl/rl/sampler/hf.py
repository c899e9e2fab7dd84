"""`HFBackend`: the `SamplerBackend` on Hugging Face transformers, for CPU or one GPU.

Its own decoding loop rather than ``model.generate``: one prefill over LEFT-padded prompts (with an
attention mask and position ids counted from each row's first real token), then one token per step
from the KV cache. Owning the loop is what makes the returned log-probs exact: each is read from
the very distribution the token was drawn from (see `Completion.logprobs`), with no warper of
``generate`` in between whose order or renormalisation we would have to trust. Stop strings
(`SamplingParams.stop`) are matched after each step on the decoded tail of each open row
(`StopStrings`), with vLLM's semantics; a call without them runs the loop as before.

The blocking loop runs on a single worker thread, so the actor's event loop keeps serving calls
and one model never runs two batches at once (on 2 CPU cores two would only slow each other).
Each decoding step holds a gate that `load_weights(in_flight=True)` takes between two steps, so
new weights can go in while a batch is being decoded (the batch goes on with them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from asyncrl.rl.generation import Completion, SamplingParams, VersionSpan, changed_spans, row_seed
from asyncrl.rl.model.sampling import sampling_logprobs
from asyncrl.rl.sampler.backend import BackendOptions, PausableBackend, Progress, WeightSink
from asyncrl.rl.sampler.errors import SamplerClosedError, SamplerTimeoutError
from asyncrl.rl.sampler.sink import ActorSink
from asyncrl.runtime.startup import start_phase

if TYPE_CHECKING:
    from asyncrl.comm.member import SyncSeat
    from asyncrl.rl.model.policy import PromptFormat


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` token ids and attention mask, each row right-aligned (left padding), so every
    row's next token comes out of the same last column."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


class HFBackend(PausableBackend):
    """Batched sampling with a transformers causal LM (``model`` in eval mode on its device). Its
    weights are the model's own tensors, so they are received in the sampler actor's process
    (`ActorSink`); `load_weights` picks the moment."""

    name = "hf"

    @classmethod
    def load(cls, model_path: str, options: BackendOptions) -> tuple[HFBackend, PromptFormat]:
        """The checkpoint's policy in fp32 on ``options.device`` (with ``options.adapter``, its
        LoRA adapters attached: syncs bring only them), and its prompt format."""
        from asyncrl.rl.model.policy import load_policy

        start_phase(f"loading {model_path}")
        model, tokenizer, fmt = load_policy(model_path, options.device, torch.float32)
        if options.adapter is not None:
            from asyncrl.rl.model.lora import attach_adapter

            model = attach_adapter(model, options.adapter)
        backend = cls(
            model,
            tokenizer=tokenizer,
            seed=options.seed,
            resume_timeout_s=options.resume_timeout_s,
            adapter_only=options.adapter is not None,
        )
        return backend, fmt

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        seed: int = 0,
        pad_token_id: int | None = None,
        resume_timeout_s: float = 600.0,
        adapter_only: bool = False,
    ):
        super().__init__(resume_timeout_s=resume_timeout_s)
        self.model = model.eval().requires_grad_(False)  # in-place weight copies need no autograd
        self.adapter_only = adapter_only  # a peft model whose syncs bring its LoRA adapters only
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id if pad_token_id is not None else _pad_id(tokenizer)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._cache = kv_cache_name(model)
        self._generator = torch.Generator(self.device).manual_seed(seed)  # requests without a seed
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-generate")
        self._gate = threading.Condition()  # between decoding steps: see load_weights
        self._stepping = False  # the worker thread is inside a decoding step
        self._loads = 0  # in-flight weight loads waiting for, or holding, the gate
        self.tokens_generated = 0  # over every call; written by the worker thread only
        self.positions_decoded = 0  # rows x steps decoded, calls still running included; likewise
        self.generate_s = 0.0

    # --- SamplerBackend -------------------------------------------------------------------------

    def _check(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        super()._check(prompts, n, params)
        if params.stop and self.tokenizer is None:
            raise ValueError("HFBackend without a tokenizer cannot match stop strings (SamplingParams.stop)")

    def _submit(
        self, prompts: list[list[int]], n: int, params: SamplingParams, progress: Progress | None = None
    ) -> concurrent.futures.Future:
        """The batch on the worker thread. Its future, not our await, ends the count in flight: a
        cancelled caller drops a batch not started yet, but one running goes on to its end.
        ``progress`` is called back on this loop after each decoding step."""
        report = None
        if progress is not None:
            loop = asyncio.get_running_loop()

            def report(row: int, ids: list[int]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
                    loop.call_soon_threadsafe(progress, row, ids)

        try:
            return self._pool.submit(self._generate_blocking, prompts, n, params, report)
        except RuntimeError as exc:  # the pool was shut down by close()
            raise SamplerClosedError("HFBackend is closed") from exc

    def tokens_decoded(self) -> int:
        """Every row of every decoding step, a row that already stopped included (it decodes in
        step with the others): it moves with each step."""
        return self.positions_decoded

    def weight_sink(self, seat: SyncSeat) -> WeightSink:
        return ActorSink(seat, self)

    @property
    def generator(self) -> torch.Generator:
        return self._generator

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        """The tensors a sync is copied into in place, named like the trainer's
        ``dict(model.named_parameters())`` (which lists tied weights once, as here); with
        ``adapter_only``, the LoRA A and B matrices alone (`adapter_tensors`). Written only
        through `load_weights`."""
        if self.adapter_only:
            from asyncrl.rl.model.lora import adapter_tensors

            return adapter_tensors(self.model)
        return dict(self.model.named_parameters())

    async def load_weights(
        self,
        load: Callable[[Mapping[str, torch.Tensor]], object],
        *,
        version: int,
        in_flight: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        """Run ``load(self.weight_tensors())`` on a worker thread at a moment no decoding step
        reads the weights, and make ``version`` theirs (`weights_version`) in that same moment, so
        each completion's `version_spans` cut exactly where its tokens' weights changed.
        ``in_flight=False``: pause, wait for the generates in flight to finish, load, resume.
        ``in_flight=True``: load between two decoding steps of the generates in
        flight, which then go on with the new weights (their KV cache and their first tokens are
        from the old ones; the log-probs returned are still those each token was drawn with).
        Raises `SamplerTimeoutError` if that moment does not come within ``timeout_s``; the
        weights are untouched then. What ``load`` raises propagates (weights may be half-written)."""
        if in_flight:
            await asyncio.to_thread(self._load_between_steps, load, version, timeout_s)
            return
        await self.pause(timeout_s)
        try:
            await asyncio.to_thread(load, self.weight_tensors())
            self.weights_version = version
        finally:
            await self.resume()

    def close(self) -> None:
        self._mark_closed()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- waiting --------------------------------------------------------------------------------

    def _load_between_steps(
        self, load: Callable[[Mapping[str, torch.Tensor]], object], version: int, timeout_s: float
    ) -> None:
        with self._gate:
            self._loads += 1  # from here on no decoding step starts
            if not self._gate.wait_for(lambda: not self._stepping, timeout_s):
                self._loads -= 1
                self._gate.notify_all()
                raise SamplerTimeoutError(f"load_weights: a decoding step did not end within {timeout_s:g} s")
        loaded = False
        try:
            load(self.weight_tensors())
            loaded = True
        finally:
            with self._gate:
                if loaded:  # before any decoding step can start again: the step reads it under the gate
                    self.weights_version = version
                self._loads -= 1
                self._gate.notify_all()

    @contextlib.contextmanager
    def _decoding_step(self) -> Iterator[None]:
        """Held by the worker thread around one step; waits while a weight load holds the gate."""
        with self._gate:
            if not self._gate.wait_for(lambda: not self._loads, self.resume_timeout_s):
                raise SamplerTimeoutError(
                    f"generate: a weight load held the model for over {self.resume_timeout_s:g} s"
                )
            self._stepping = True
        try:
            yield
        finally:
            with self._gate:
                self._stepping = False
                self._gate.notify_all()

    # --- the blocking part (worker thread) ------------------------------------------------------

    def _generate_blocking(
        self, prompts: list[list[int]], n: int, params: SamplingParams, report: Progress | None = None
    ) -> list[list[Completion]]:
        start = time.perf_counter()
        rows = [p for p in prompts for _ in range(n)]  # prompt-major: row i*n + j is sample j of prompt i
        generators = None
        if params.seed is not None:
            generators = [
                torch.Generator(self.device).manual_seed(row_seed(params.seed, i, j))
                for i in range(len(prompts))
                for j in range(n)
            ]
        exact = params.exact_lengths
        if exact:  # rows decode in step anyway: run the longest, nothing stops them, then cut each
            params = msgspec.structs.replace(params, max_new_tokens=max(exact), stop_token_ids=[], stop=[])
        strings = StopStrings(self.tokenizer, params.stop, len(rows)) if params.stop else None
        tokens, logprobs, stops_at, top, spans = self._decode(rows, params, generators, strings, report)
        completions = self._completions(tokens, logprobs, stops_at, params, strings, top, spans)
        self.tokens_generated += sum(len(c.token_ids) for c in completions)
        self.generate_s += time.perf_counter() - start
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.inference_mode()
    def _decode(
        self,
        rows: list[list[int]],
        params: SamplingParams,
        generators: list[torch.Generator] | None,
        strings: StopStrings | None,
        report: Progress | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None, list[VersionSpan]]:
        """Token ids and log-probs ``[B, T]``, per row the step of its first stop token or of the
        token that completed a stop string (``T`` if none), with ``params.top_logprobs`` k the
        k most likely tokens and their log-probs ``[B, T, k]`` (else None), and the weight
        versions the steps ran under (every row decodes in step, so one list serves all). Rows that stopped keep
        decoding (their tokens are cut off later) until every row stopped: a row's result never
        depends on the others."""
        ids, mask = (t.to(self.device) for t in pad_left(rows, self.pad_token_id))
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # left padding: count from the first real token
        next_position = positions[:, -1:] + 1
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        never = params.max_new_tokens
        stops_at = torch.full((len(rows),), never, dtype=torch.long, device=self.device)
        tokens, logprobs, top_ids, top_lps = [], [], [], []
        so_far: list[list[int]] = [[] for _ in rows]  # for report: each open row's tokens
        spans: list[VersionSpan] = []
        out = None
        token = ids[:, -1]  # replaced by each step's sampled tokens before it is read
        for step in range(params.max_new_tokens):
            with self._decoding_step():
                if not spans or spans[-1].version != self.weights_version:  # read under the gate: loads change it
                    spans.append(VersionSpan(step, self.weights_version))
                if out is None:
                    out = self.model(
                        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
                    )
                else:
                    mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
                    out = self.model(
                        input_ids=token[:, None],
                        attention_mask=mask,
                        position_ids=next_position,
                        use_cache=True,
                        **{self._cache: getattr(out, self._cache)},
                    )
                    next_position = next_position + 1
                token, logprob, top = self._choose(out.logits[:, -1, :], params, generators)
                if top is not None:
                    top_lps.append(top.values)
                    top_ids.append(top.indices)
                hit = torch.isin(token, stop_ids) & (stops_at == never)
                stops_at = torch.where(hit, step, stops_at)
                # bool() waits for the device: this step's kernels are done before the gate opens
                all_stopped = bool((stops_at < never).all())
                self.positions_decoded += len(rows)
            if strings is not None and not all_stopped:  # a stop token wins over a string in the same step
                open_rows = (stops_at == never).tolist()
                for row in strings.completed(token.tolist(), open_rows):
                    stops_at[row] = step
                all_stopped = bool((stops_at < never).all())
            tokens.append(token)
            logprobs.append(logprob)
            if report is not None:
                for row, (t, stop) in enumerate(zip(token.tolist(), stops_at.tolist())):
                    if stop >= step:  # open until this step: its token is its own
                        so_far[row].append(t)
                        report(row, list(so_far[row]))
            if all_stopped:
                break
        top = (torch.stack(top_ids, 1).cpu(), torch.stack(top_lps, 1).cpu()) if top_ids else None
        return torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1).cpu(), stops_at.cpu(), top, spans

    def _choose(
        self, logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator] | None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        logp = sampling_logprobs(logits, params.temperature, params.top_p)
        top = logp.topk(params.top_logprobs, dim=-1) if params.top_logprobs else None
        if params.temperature == 0:
            token = logp.argmax(dim=-1)
        elif generators is None:
            token = torch.multinomial(logp.exp(), 1, generator=self._generator).squeeze(1)
        else:  # one draw per row from its own stream: reproducible whatever else is in the batch
            probs = logp.exp()
            token = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])
        return token, logp.gather(1, token[:, None]).squeeze(1), top

    def _completions(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        stops_at: torch.Tensor,
        params: SamplingParams,
        strings: StopStrings | None,
        top: tuple | None = None,
        spans: list[VersionSpan] | None = None,
    ) -> list[Completion]:
        ids_rows, lp_rows, reasons, by_string = [], [], [], []
        for i, (row, lps, stop) in enumerate(zip(tokens.tolist(), logprobs.tolist(), stops_at.tolist())):
            end = stop + 1 if stop < params.max_new_tokens else len(row)  # the stop token is kept, with its log-prob
            if params.exact_lengths:  # nothing stopped it: its length did
                end, stop = params.exact_lengths[i], params.max_new_tokens
            ids_rows.append(row[:end])
            lp_rows.append(lps[:end])
            reasons.append("stop" if stop < params.max_new_tokens else "length")
            by_string.append(strings is not None and i in strings.stopped)
        # Without the stop token; a row stopped by a string keeps every token (as vLLM's do) and
        # its text ends before the string (vLLM's default, include_stop_str_in_output=False).
        texts = self._decode_text(
            [ids[:-1] if r == "stop" and not s else ids for ids, r, s in zip(ids_rows, reasons, by_string)]
        )
        texts = [text_before_stop(t, params.stop) if s else t for t, s in zip(texts, by_string)]
        tops: list[list] = [[] for _ in ids_rows]
        if top is not None:
            for i, (row_ids, row_lps) in enumerate(zip(top[0].tolist(), top[1].tolist())):
                tops[i] = [list(zip(a, b)) for a, b in zip(row_ids[: len(ids_rows[i])], row_lps[: len(ids_rows[i])])]
        return [
            Completion(ids, lps, text, reason, top_logprobs=t, version_spans=changed_spans(spans or [], len(ids)))
            for ids, lps, text, reason, t in zip(ids_rows, lp_rows, texts, reasons, tops)
        ]

    def _decode_text(self, rows: list[list[int]]) -> list[str]:
        # As the evaluation (asyncrl.rl.model.evaluation.solve_rate) reads a completion: without its stop token, special
        # tokens skipped, so a group's rewards and the held-out solve rate score text alike.
        if self.tokenizer is None:
            return [""] * len(rows)
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class StopStrings:
    """Which rows' text, decoded as `Completion.text` is (special tokens skipped), has just
    completed one of ``stops``. Each step decodes only a row's last ``window`` tokens: enough
    for the longest stop string even at one byte per token (a byte-level token may hold part of a
    character; the partial bytes at the window's start decode to U+FFFD, which no check needs).
    An occurrence is looked for only where this step's token could have completed it."""

    def __init__(self, tokenizer: Any, stops: list[str], rows: int):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.window = 4 * max(len(s) for s in stops) + 4  # UTF-8: at most 4 bytes a character
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.stopped: set[int] = set()

    def completed(self, tokens: list[int], open_rows: list[bool]) -> list[int]:
        """Append this step's ``tokens`` (one per row); the open rows whose text now holds a stop
        string that it did not hold before."""
        rows = [i for i, is_open in enumerate(open_rows) if is_open]
        for i in rows:
            self.ids[i].append(tokens[i])
        tails = self.tokenizer.batch_decode(
            [self.ids[i][-self.window :] for i in rows], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        hits = [i for i, tail in zip(rows, tails) if any(s in tail for s in self.stops)]
        self.stopped.update(hits)
        return hits


def text_before_stop(text: str, stops: list[str]) -> str:
    """``text`` up to the stop string that completes first in it (vLLM's choice when several do;
    ties: the first listed), that string excluded; all of it when none occurs."""
    best, cut = len(text) + 1, len(text)
    for s in stops:
        at = text.find(s)
        if at >= 0 and at + len(s) < best:
            best, cut = at + len(s), at
    return text[:cut]


def kv_cache_name(model: Any) -> str:
    """The name under which ``model``'s forward takes the KV cache and its output returns it:
    ``cache`` where the forward has that parameter (transformers 5.24 renamed it; there
    ``past_key_values`` is a deprecated alias, to be removed in 5.40), else ``past_key_values``
    (5.0 to 5.23). Read off the signature rather than the version, so a model whose forward keeps
    the old name (remote code, say) keeps being given it; a peft model's forward takes
    ``**kwargs``, so its base model's is read."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _pad_id(tokenizer: Any) -> int:
    """Any id works as padding (it is masked out); prefer the tokenizer's own."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0
