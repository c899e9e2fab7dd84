"""`VLLMBackend`: the `SamplerBackend` on vLLM's ``AsyncLLM``, for one GPU or CPU.

The engine is driven from the sampler actor's event loop: each prompt is one vLLM request with
``n`` samples, log-probs of the sampled tokens as the sampler drew them (vLLM's
``processed_logprobs``: after temperature and top-p, the `Completion.logprobs` contract), and
``FINAL_ONLY`` output (with ``n > 1`` a streamed last message may lack samples). A caller that
goes away (cancelled, timed out) aborts its requests in the engine.

The model lives in vLLM's engine-core process, a child of the sampler actor. That process, not
the actor, joins the trainer's weight-sync group and receives every bucket from the
communicator (``worker.py``, `WeightSyncExtension`); the backend's `EngineSink` (``sink.py``)
sends it small control values through ``collective_rpc``. A sync in pause mode stops new
requests, waits for those running, loads, resets the prefix cache and resumes. In in-flight mode
the engine loads between two of its steps while requests keep running (their KV cache so far is
from the old weights, as with the HF backend), and the prefix cache is off, so no later request
reuses a prefix computed before.

The engine-core process is in the actor's process group, which the runtime signals as a whole
on every way an actor ends (stop, crash, SIGKILL, the supervisor's death); what vLLM leaves
outside its processes is the `Janitor`'s (``janitor.py``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from asyncrl.rl.config.sampler import STAGE_MODES
from asyncrl.rl.generation import Completion, SamplingParams, VersionSpan, changed_spans, row_seed
from asyncrl.rl.sampler.backend import BackendOptions, PausableBackend, Progress, WeightSink
from asyncrl.rl.sampler.errors import SamplerError, SamplerTimeoutError
from asyncrl.rl.sampler.vllm import compat
from asyncrl.rl.sampler.vllm.adapter import EngineAdapters, engine_lora_options, lora_dtype_refusal
from asyncrl.rl.sampler.vllm.engine_exit import STARTER
from asyncrl.rl.sampler.vllm.engine_setup import DEFAULT_CPU_KV_CACHE_GIB, engine_args, vllm_unusable
from asyncrl.rl.sampler.vllm.janitor import Janitor, keep_compile_cache, shm_names
from asyncrl.rl.sampler.vllm.request_versions import RequestVersions
from asyncrl.rl.sampler.vllm.shared import ClientSink, EngineShare, EngineWatch, incarnation
from asyncrl.rl.sampler.vllm.sink import EngineSink, engine_call
from asyncrl.runtime.startup import start_phase
from asyncrl.runtime.timeouts import timeout

if TYPE_CHECKING:
    from asyncrl.comm.member import SyncSeat
    from asyncrl.rl.model.policy import PromptFormat

_SCRATCH_ENVIRON = ("VLLM_RPC_BASE_PATH", "TMPDIR")
"""What `VLLMBackend._start_engine` points at the engine's own scratch directory while it runs."""


class VLLMBackend(PausableBackend):
    """Sampling with vLLM's ``AsyncLLM`` on ``device`` (``cpu`` with a CPU build of vLLM, or the
    actor's one GPU). ``dtype`` is the engine's ("float32" by default on CPU, so log-probs match
    an fp32 trainer; "auto": the checkpoint's). ``prefix_caching``: off for in-flight weight
    updates (see the module docstring). ``kv_cache_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` on CPU
    where it is not set; ``gpu_memory_utilization`` is vLLM's on GPU. ``engine`` holds any other
    ``AsyncEngineArgs`` fields. ``stage_weights`` ("auto", "on", "off"): on a GPU, receive syncs
    into a copy of the weights beside the engine while it decodes (`asyncrl.comm.staged`; "auto":
    where the copy is at most 1/16 of the GPU's memory). ``engine_stats``: keep the engine's
    statistics, and count its preemptions and peak KV cache use (`engine_counts`). Must be
    constructed with the actor's event loop running.

    The weights live in the engine's process, which receives them itself (`weight_sink`). With
    ``adapter`` (a `LoRAConfig`), syncs bring LoRA adapters only: this process receives them and the
    engine serves them through vLLM's LoRA path (`adapter.py`). With ``share`` (an `EngineShare`),
    the engine is one of several samplers (``shared.py``): its host starts it and takes the
    weights, the others attach to it and are told of each sync (`ClientSink`).
    """

    name = "vllm"
    batches_requests = True
    shares_engines = True

    @classmethod
    def load(cls, model_path: str, options: BackendOptions) -> tuple[VLLMBackend, PromptFormat]:
        """An engine on the checkpoint at ``model_path`` (the engine loads the weights itself, and
        on a fresh GPU machine compiles it: its start phase has ``options.start_timeout_s``), and
        the checkpoint's prompt format; ``options.vllm``: this class's other keyword arguments."""
        from asyncrl.rl.model.policy import load_prompt_format

        start_phase(
            f"loading {model_path} and building the vLLM engine (compile, CUDA graphs)",
            budget_s=options.start_timeout_s,
            knob="--sampler.engine_start_timeout_s",
        )
        tokenizer, fmt = load_prompt_format(model_path)
        # An adapter sync changes no weight under a running batch: the prefix cache stays valid.
        extra = {"prefix_caching": not options.in_flight or options.adapter is not None} | dict(options.vllm)
        backend = cls(
            model_path,
            tokenizer=tokenizer,
            seed=options.seed,
            device=options.device,
            resume_timeout_s=options.resume_timeout_s,
            adapter=options.adapter,
            start_timeout_s=options.start_timeout_s,
            **extra,
        )
        return backend, fmt

    @classmethod
    def digestible_on(cls, device: torch.device) -> bool:
        return device.type == "cuda"  # elsewhere (the CPU) the engine repacks them for its kernels

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer: Any = None,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: str = "",
        max_model_len: int = 0,
        prefix_caching: bool = True,
        kv_cache_gib: int = 0,
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool | None = None,
        resume_timeout_s: float = 600.0,
        engine: dict | None = None,
        adapter: Any = None,
        stage_weights: str = "auto",
        engine_stats: bool = False,
        start_timeout_s: float = 0.0,
        share: EngineShare | None = None,
    ):
        super().__init__(resume_timeout_s=resume_timeout_s)
        self.share = share
        """Where this sampler sits among the clients of a shared engine (`shared.py`); None: an engine of its own."""
        self.device = torch.device(device)
        self.start_timeout_s = start_timeout_s  # the warm-up's budget, as the start's (`warm_up`)
        if stage_weights not in STAGE_MODES:
            raise ValueError(f"stage_weights must be one of {', '.join(STAGE_MODES)}, not {stage_weights!r}")
        self.stage_weights = stage_weights
        self._prepare_device(kv_cache_gib)
        self.tokenizer = tokenizer
        self.seed = seed
        self.prefix_caching = prefix_caching
        if adapter is not None:
            engine = engine_lora_options(adapter) | dict(engine or {})
        args = engine_args(
            model_path,
            device=self.device,
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            prefix_caching=prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            engine=engine,
            stats=engine_stats,
        )
        if adapter is not None:
            _check_adapter_engine(args["dtype"], self.device.type, share)
        self.engine_counts: dict[str, float] | None = {} if engine_stats else None
        """With ``engine_stats``: the engine's preemptions and peak KV cache use (`compat.engine_counter`)."""
        self._preemptions_taken = 0  # of those, what `take_engine_window` has given out
        self.engine_gone = ""  # a client of a shared engine: why the engine is gone, once it is
        self._watch: EngineWatch | None = None
        self._engine_paused = False
        if share is not None and not share.is_host:
            self._attach(args, share)
        else:
            self._start_engine(args)
        self.kv_cache_tokens = compat.kv_cache_tokens(self.engine)
        self.adapters = (
            EngineAdapters(self.engine, model_path, adapter, self._scratch, on_loaded=self._adapter_loaded)
            if adapter is not None
            else None
        )
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.dtype = compat.engine_dtype(self.engine)
        self._next_id = 0
        self._prefix = uuid.uuid4().hex[:8]
        self.marker = f"asyncrl-{self._prefix}-"
        """In vLLM's id of every request of this backend, and of no other's (shared engines' clients)."""
        self._versions = RequestVersions()  # the version spans of the requests running
        self.tokens_generated = 0
        self.tokens_finished = 0  # of requests that ended (`tokens_decoded` adds the running ones')
        self.generate_s = 0.0
        self.engine_exit_codes: list[int | None] = []
        """After `close`: how vLLM's engine-core processes ended: 0 when by themselves; where
        vLLM's shutdown grace (5 s) ran out and it killed one, -9, or None while the killed
        process is not yet reaped (`engine_exit.py` keeps that from happening)."""

    def _prepare_device(self, kv_cache_gib: int) -> None:
        """Refuse a device vLLM cannot run on here; set the environment its engine reads there."""
        if isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, int) or kv_cache_gib < 0:
            raise ValueError(
                f"kv_cache_gib must be a whole number of GiB >= 0 (0: {DEFAULT_CPU_KV_CACHE_GIB}), not {kv_cache_gib!r}"
            )
        why = vllm_unusable(self.device)
        if why:
            raise SamplerError(f"VLLMBackend on {self.device.type}: {why}")
        if self.device.type == "cpu":
            # The engine's processes inherit our environment; vLLM reads these there. Unpinned
            # threads (OMP_NUM_THREADS of them): vLLM's default pins its threads to cores and
            # keeps one for itself, which on a host shared with a trainer takes cores from it.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib or DEFAULT_CPU_KV_CACHE_GIB))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        compat.environ_defaults(compat.engine_environment(self.device.type))

    def _start_engine(self, args: dict[str, Any]) -> None:
        """``self.engine``, started from ``args``. vLLM leaves its ZeroMQ socket files (and, for a
        multi-process executor, a file store) in the temporary directory, and its shared-memory
        queues when it is killed: it gets a directory of its own, and a janitor that removes both
        whenever this process ends. torch.compile's cache stays where it was (`keep_compile_cache`)."""
        self._scratch = tempfile.mkdtemp(prefix=f"asyncrl-vllm-{os.getpid()}-")
        keep_compile_cache(self._scratch)
        # Put back by `close`, which removes the directory: a process that outlives its engine (an
        # evaluation's, a test's) must not go on making temporary files, or children, under it.
        self._environ_before = {key: os.environ.get(key) for key in _SCRATCH_ENVIRON}, tempfile.tempdir
        os.environ["VLLM_RPC_BASE_PATH"] = os.environ["TMPDIR"] = self._scratch
        os.environ[STARTER] = str(os.getpid())  # its processes exit without a last full GC (engine_exit.py)
        self._janitor: Janitor | None = Janitor(self._scratch)
        followed = self._janitor.follow(shm_names())
        try:
            if self.share is None:
                self.engine = compat.make_engine(args, self.engine_counts)
            else:  # the host of a shared engine: the core, for every client's slots, and its own client
                slot = self.share.slot(incarnation())
                self.engine = compat.start_shared_engine(args, self.share.addresses(), slot, self.engine_counts)
        except BaseException:
            followed()
            self._janitor.finish()
            self._restore_environ()
            raise
        followed()

    def _attach(self, args: dict[str, Any], share: EngineShare) -> None:
        """``self.engine``: a client of ``share.host``'s engine, which may still be starting (its
        own budget, ``start_timeout_s``, bounds the wait). Owns no process, so no scratch directory
        or janitor: the engine and what it leaves are the host's."""
        wait_s = self.start_timeout_s or 900.0
        knob = "--sampler.engine_start_timeout_s"
        start_phase(f"attaching to {share.host}'s vLLM engine", budget_s=wait_s, knob=knob)
        refusal = compat.shared_engine_refusal()
        if refusal:
            raise SamplerError(f"--sampler.clients_per_engine: {refusal}")
        self._janitor = None
        slot = share.slot(incarnation())
        try:
            self.engine = compat.attach_to_engine(args, share.addresses(), slot, wait_s, self.engine_counts)
        except TimeoutError:
            why = f"{share.host}'s vLLM engine did not answer this client within {wait_s:g} s ({knob})"
            raise SamplerError(why) from None

    def _engine_ended(self, host: str, pid: int) -> None:
        """``host``'s engine's process ended: shut this client, so that its generates fail at once
        (vLLM's `EngineDeadError`, raised as a `SamplerError`)."""
        self.engine_gone = f"{host}'s vLLM engine ended (its process {pid} exited)"
        print(f"VLLMBackend: {self.engine_gone}: this sampler cannot generate any more", flush=True)
        if self.engine is not None:
            compat.engine_lost(self.engine)

    # --- SamplerBackend -------------------------------------------------------------------------

    def _submit(
        self, prompts: list[list[int]], n: int, params: SamplingParams, progress: Progress | None = None
    ) -> asyncio.Task:
        """A task: cancelling it (a caller that went away) aborts its requests in the engine.
        With ``progress``, the engine reports each request's tokens as it generates them."""
        return asyncio.ensure_future(self._generate(prompts, n, params, progress))

    def loaded_adapters(self) -> int | None:
        return len(self.adapters.loaded) if self.adapters is not None else None

    async def warm_up(self, prompt: list[int], params: SamplingParams) -> None:
        """vLLM compiles its sampling ops (torch.compile: log-prob ranks, random sampling) in the
        engine's process on their first use: seconds of a C++ compiler on a CPU host, and again,
        shorter, once a second batch size makes a dimension dynamic. Two short generates do it."""
        start_phase(
            "compiling vLLM's sampling ops (two short generates)",
            budget_s=self.start_timeout_s,
            knob="--sampler.engine_start_timeout_s",
        )
        params = msgspec.structs.replace(params, max_new_tokens=2)
        for prompts, n in (([prompt], 3), ([prompt, prompt], 1)):  # batches of 3, then 2 sequences
            await self.generate(prompts, n, params)
        if self.share is not None and not self.share.is_host and self._watch is None:
            pid = await engine_call(self, "pid", 30.0)
            self._watch = EngineWatch(pid, functools.partial(self._engine_ended, self.share.host))

    def weight_sink(self, seat: SyncSeat) -> WeightSink:
        if self.adapters is not None:  # adapters only: received here, in the actor
            from asyncrl.rl.sampler.sink import ActorSink

            return ActorSink(seat, self.adapters)
        if self.share is not None and not self.share.is_host:
            return ClientSink(self, self.share.host)
        return EngineSink(self)

    async def pause(self, timeout_s: float = 600.0) -> None:
        """As every backend's; the host of a shared engine then also waits for the other clients'
        requests in it, and holds their new ones in the engine (vLLM's pause in its "wait" mode),
        all within ``timeout_s``: a load in pause mode then runs under no request of any client."""
        deadline = time.monotonic() + timeout_s
        await super().pause(timeout_s)
        if self.share is None or not self.share.is_host:
            return
        self._engine_paused = True
        try:
            async with timeout(max(deadline - time.monotonic(), 1e-3)):
                await compat.pause_engine(self.engine)
        except TimeoutError:
            await self.resume()
            raise SamplerTimeoutError(
                f"pause: the requests of the engine's other clients did not finish within {timeout_s:g} s"
            ) from None
        except BaseException:
            await self.resume()
            raise

    async def resume(self) -> None:
        try:
            if self._engine_paused:
                self._engine_paused = False
                await compat.resume_engine(self.engine)
        finally:
            await super().resume()

    def request_mark(self) -> int:
        """The number the next request will take: every request from it on is sent after now."""
        return self._next_id

    def close(self) -> None:
        """Shut the engine down (its process ends with it). Idempotent."""
        if self._closed:
            return
        self._mark_closed()
        engine, self.engine = self.engine, None
        if self._watch is not None:
            self._watch.close()
        processes = compat.engine_processes(engine)
        # Shut down now and drop the engine, so its __del__ (which shuts down again) runs here and
        # not at interpreter exit, when the modules it needs are gone.
        try:
            engine.shutdown()
            del engine
        finally:
            if self._janitor is not None:
                self._janitor.finish()
                self._restore_environ()
        self.engine_exit_codes = [p.exitcode for p in processes]

    def _restore_environ(self) -> None:
        """The temporary directory as it was before `_start_engine` pointed it at the scratch one."""
        values, tempfile.tempdir = self._environ_before
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    # --- generation -------------------------------------------------------------------------------

    async def _generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, progress: Progress | None = None
    ) -> list[list[Completion]]:
        start = time.perf_counter()
        calls: list[tuple[list[int], Any, Callable[[int, list[int]], None] | None]]
        if params.exact_lengths:  # a request per row, each as long as it was told
            per_request, repeat = 1, 1
            calls = [
                (prompt, self._params(_exactly(params, params.exact_lengths[i * n + j]), 1, i, sample=j), None)
                for i, prompt in enumerate(prompts)
                for j in range(n)
            ]
        else:
            # vLLM refuses n > 1 when greedy; the n greedy samples are one sample n times anyway.
            per_request = 1 if params.temperature == 0 else n
            repeat = n // per_request
            calls = [
                (prompt, self._params(params, per_request, i, progress), _rows(progress, i, n, per_request))
                for i, prompt in enumerate(prompts)
            ]
        first, self._next_id = self._next_id, self._next_id + len(calls)
        request_ids = [f"{self.marker}{first + i}" for i in range(len(calls))]
        lora = self.adapters.acquire() if self.adapters is not None else None  # one adapter for the batch
        requests = [
            asyncio.ensure_future(self._request(rid, first + i, prompt, request_params, lora, report))
            for i, (rid, (prompt, request_params, report)) in enumerate(zip(request_ids, calls))
        ]
        try:
            outputs = await asyncio.gather(*requests)
        except BaseException as exc:
            # Unwanted now (cancelled caller, a failed sibling): free the engine of all of them.
            for r in requests:
                r.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
            await asyncio.shield(self._abort(request_ids))
            if self.engine_gone and not isinstance(exc, asyncio.CancelledError):
                raise SamplerError(self.engine_gone) from exc
            raise
        finally:
            if lora is not None and self.adapters is not None:
                await asyncio.shield(self.adapters.release(lora))
        rows = [c for out, spans in outputs for c in self._completions(out, spans, params, per_request) * repeat]
        groups = [rows[i * n : (i + 1) * n] for i in range(len(prompts))]
        self.tokens_generated += sum(len(c.token_ids) for g in groups for c in g)
        self.generate_s += time.perf_counter() - start
        return groups

    async def _request(
        self,
        request_id: str,
        number: int,
        prompt: list[int],
        params: Any,
        lora: Any = None,
        report: Callable[[int, list[int]], None] | None = None,
    ) -> tuple[Any, list[list[VersionSpan]]]:
        """The request's final output, and per sample the weight versions its tokens were
        sampled under (`weights_changed` keeps them while it runs)."""
        final = None
        latest: dict[int, Any] = {}  # streamed (cumulative), an output holds only the samples that moved
        spans = self._versions.begin(request_id, number, params.n, self.weights_version)
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt}, params, request_id, lora_request=lora):
                final = out
                for sample in out.outputs:
                    latest[sample.index] = sample
                    if report is not None:
                        report(sample.index, list(sample.token_ids))
        finally:
            self._versions.end(request_id)
        if final is None or not final.finished:
            raise SamplerError(f"vLLM request {request_id} ended without a final output")
        self.tokens_finished += sum(len(sample.token_ids) for sample in latest.values())
        final.outputs = [latest[i] for i in sorted(latest)]
        return final, spans

    def tokens_decoded(self) -> int:
        engine = self.engine
        return self.tokens_finished + (compat.tokens_in_flight(engine) if engine is not None else 0)

    def engine_stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = dict(self.engine_counts or {})
        stats.pop("kv_cache_window_peak", None)
        if self.kv_cache_tokens:
            stats["kv_cache_tokens"] = self.kv_cache_tokens
        return stats

    def take_engine_window(self) -> tuple[int, float] | None:
        counts = self.engine_counts
        if counts is None:
            return None
        preemptions = int(counts.get("preemptions", 0)) - self._preemptions_taken
        self._preemptions_taken += preemptions
        peak, counts["kv_cache_window_peak"] = counts.get("kv_cache_window_peak", 0.0), 0.0
        return preemptions, peak

    def weights_changed(self, version: int, positions: dict[str, int] | None, since: int) -> None:
        """New weights (``version``) are in the engine; ``positions``: where each request stood
        then, by vLLM's internal id (`compat.request_positions`; {} when none ran across the load,
        None when the worker could not tell); ``since``: the `request_mark` taken before the load
        was asked for. Each running request's spans follow `RequestVersions`' rule: exact where the
        table lists it, else over-counted, never hidden. A request that ended between the load and
        this call keeps the old version for its last tokens, likewise over-counted."""
        self.weights_version = version
        self._versions.changed(version, positions, since)

    def _adapter_loaded(self, version: int) -> None:
        """A LoRA sync made ``version``'s adapter the engine's: batches running keep theirs."""
        self.weights_version = version

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await self.engine.abort(request_ids)
        except Exception as exc:  # a dead engine has nothing left to abort
            print(f"VLLMBackend: aborting {len(request_ids)} requests failed: {exc!r}", flush=True)

    def _params(
        self, params: SamplingParams, n: int, prompt_index: int, progress: Progress | None = None, sample: int = 0
    ) -> Any:
        return compat.sampling_params(
            cumulative=progress is not None,  # each output so far, not the final one only
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            # Exactly our stop tokens: vLLM would otherwise also stop at the model's EOS.
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            stop=list(params.stop) or None,
            seed=None if params.seed is None else row_seed(params.seed, prompt_index, sample),
            logprobs=params.top_logprobs,
            detokenize=bool(params.stop),
            skip_special_tokens=True,
        )

    def _completions(
        self, out: Any, spans: list[list[VersionSpan]], params: SamplingParams, n: int
    ) -> list[Completion]:
        samples = sorted(out.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise SamplerError(f"vLLM request {out.request_id} returned {len(samples)} samples, not {n}")
        completions = []
        for c in samples:
            ids = list(c.token_ids)
            logprobs = compat.sampled_logprobs(c.logprobs, ids)
            if logprobs is None:
                raise SamplerError(f"vLLM request {out.request_id}: log-probs missing for some sampled tokens")
            if c.finish_reason not in ("stop", "length"):
                raise SamplerError(f"vLLM request {out.request_id} finished with {c.finish_reason!r}")
            by_string = isinstance(c.stop_reason, str)
            if by_string:
                text = c.text  # vLLM cut it before the stop string
            else:
                stopped = c.finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids
                text = self._decode_text(ids[:-1] if stopped else ids)
            top = compat.top_logprobs(c.logprobs, params.top_logprobs) if params.top_logprobs else []
            reason = "stop" if c.finish_reason == "stop" else "length"
            versions = changed_spans(spans[c.index], len(ids))
            completions.append(Completion(ids, logprobs, text, reason, top_logprobs=top, version_spans=versions))
        return completions

    def _decode_text(self, ids: list[int]) -> str:
        # As HFBackend (and the held-out evaluation) read a completion: rewards score the same text.
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _check_adapter_engine(dtype: str, device_type: str, share: EngineShare | None) -> None:
    """Raise `SamplerError` where LoRA adapter syncs cannot reach this engine: its dtype on this
    device, or an engine shared by several samplers (each would take the adapters its own way)."""
    refusal = lora_dtype_refusal(dtype, device_type)
    if share is not None:
        refusal = "a shared vLLM engine takes no LoRA adapter syncs (--trainer.lora.sync merged)"
    if refusal:
        raise SamplerError(refusal)


def _rows(progress: Progress | None, prompt: int, n: int, per_request: int) -> Callable[[int, list[int]], None] | None:
    """``progress`` for prompt ``prompt``'s request, by sample index: its rows are ``prompt * n + j``;
    a greedy request (one sample for n) reports its tokens for every one of its n rows."""
    if progress is None:
        return None

    def report(sample: int, ids: list[int]) -> None:
        for j in range(n) if per_request == 1 else (sample,):
            progress(prompt * n + j, ids)

    return report


def _exactly(params: SamplingParams, length: int) -> SamplingParams:
    """``params`` for one row that must run ``length`` tokens: nothing stops it before."""
    return msgspec.structs.replace(params, max_new_tokens=length, stop_token_ids=[], stop=[], exact_lengths=[])
