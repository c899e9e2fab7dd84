"""`SamplerActor`: walks its task's train split, runs ``group_size`` episodes per problem
continuously (one completion each for a single-turn task, several turns with an environment),
scores them and streams one `RolloutGroup` per problem, each tagged with the weight version it was
generated under (the oldest one, when weights changed in flight or between turns).

The task is the user's code, built here from its spec (`load_task`); its episodes run through
the `EpisodeRunner` (``tasks/episodes.py``), its score and step calls under deadlines
(`UserCalls`): a failing call scores 0 and is counted, and too many failures end the stream with
a `TaskFailureError`, which stops the run instead of restarting the sampler.

An `Agent` task (the user's code talking to the policy through the OpenAI API, docs/agents.md)
runs through an `AgentRunner` instead: the actor serves an `OpenAIServer` (``rl/agents/``) over
its own generation, each episode in a session of its own, and its groups are assembled from the
token ids the sessions recorded. `openai_endpoint` serves the same endpoint to anyone with its token.

It generates with a `SamplerBackend` (``backend.py``) whose class `backend_class` (``factory.py``)
picks, once, and which loads itself: `HFBackend` (``hf.py``) or `VLLMBackend` (``vllm/backend.py``);
what differs between them the backend says (`batches_requests`, `warm_up`, ...). The trainer's weights
reach the backend through its `WeightSink`, held by the actor's ``weights`` (`WeightReceiving`,
``weight_receiving.py``: the seat in the group, the version, the gate), to which the weight-sync
endpoints forward in one line each, wherever the weights live (here, or in vLLM's engine
process); every generate goes through ``generation`` (`GatedGeneration`, ``generation.py``),
behind that gate. A problem's samples go out as one `RolloutGroup` (``groups.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator
from typing import cast

import msgspec
import torch

from asyncrl.comm.member import SyncEndpoints, SyncSide
from asyncrl.rl.actor_device import actor_device
from asyncrl.rl.agents.runner import AgentRunner
from asyncrl.rl.agents.server import OpenAIServer
from asyncrl.rl.checkpoint import SamplerDataState
from asyncrl.rl.config.lengths import LengthProfile
from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.config.sampler import CPU_PROMPTS_PER_BATCH, SamplerConfig
from asyncrl.rl.config.trainer import LoRAConfig
from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.model.heldout import HeldoutSet
from asyncrl.rl.model.tally import HeldoutPart
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.sampler.backend import BackendOptions, SamplerSyncStats
from asyncrl.rl.sampler.errors import SamplerError
from asyncrl.rl.sampler.factory import backend_class
from asyncrl.rl.sampler.generation import GatedGeneration
from asyncrl.rl.sampler.groups import rollout_group
from asyncrl.rl.sampler.stats import SamplerStats
from asyncrl.rl.sampler.vllm.shared import EngineShare
from asyncrl.rl.sampler.walk import CountedWalk, shuffled_walk
from asyncrl.rl.sampler.weight_receiving import WeightReceiving
from asyncrl.rl.tasks.agent import Agent
from asyncrl.rl.tasks.base import as_prompt
from asyncrl.rl.tasks.episodes import EpisodeRunner
from asyncrl.rl.tasks.loading import TaskSpec, load_task
from asyncrl.rl.tasks.scoring import TaskFailureError, UserCalls
from asyncrl.runtime.actor import endpoint
from asyncrl.runtime.startup import start_phase
from asyncrl.runtime.timeouts import timeout

EVAL_PARTS_AT_ONCE = 64
"""Parts of a held-out evaluation a vLLM sampler has in flight at once (its engine schedules
them with the rollouts): every part of a default evaluation's shard."""


class SamplerActor(SyncEndpoints):
    """Generates a task's rollouts continuously and takes weights from the trainer (rank 0).

    ``config`` is the run's sampler section whole: group size, prompts per batch, sampling
    (``max_new_tokens`` 0: the model format's hint; stop tokens: the format's), how weights enter
    (``weight_update``) and the backend ("hf", "vllm", or "auto": vLLM where it is usable here,
    see `choose_backend`). ``task`` (the spec every process builds the task from) and ``data``
    give the train split the sampler walks; ``data`` must be the driver's, since the train split
    excludes the held-out problems. ``name`` tags the
    groups; empty means the actor's own name in the runtime. ``cpu_threads`` > 0 sets torch's
    intra-op threads (0: torch's default); on CPU, give each process no more threads than cores
    it has to itself: oversubscribed OpenMP threads spin and slow a small model tenfold or more.
    ``vllm`` holds extra keyword arguments of `VLLMBackend` (e.g. ``gpu_memory_utilization``).
    ``adapter``: the trainer trains these LoRA adapters and syncs only them (`BackendOptions`).
    ``engine_share``: this sampler's place among the clients of a shared vLLM engine
    (``--sampler.clients_per_engine``, ``vllm/shared.py``); None: an engine of its own.
    """

    def __init__(
        self,
        model_path: str,
        config: SamplerConfig = SamplerConfig(),
        *,
        task: TaskSpec | None = None,
        data: DataConfig = DataConfig(),
        seed: int = 0,
        device: str = "cpu",
        sync_timeout_s: float = 120.0,
        cpu_threads: int = 0,
        name: str = "",
        vllm: dict | None = None,
        adapter: LoRAConfig | None = None,
        engine_share: EngineShare | None = None,
    ):
        task = TaskSpec("countdown") if task is None else task  # built per call: its options are a dict
        if not sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, not {sync_timeout_s!r}")
        self.config = config
        self.name = name or os.environ.get("ASYNCRL_ACTOR", "") or "sampler"
        self.group_size, self.prompts_per_batch = config.group_size, config.prompts_per_batch or CPU_PROMPTS_PER_BATCH
        self.in_flight = config.weight_update == "in_flight"
        self.device = actor_device(device)
        if cpu_threads > 0:
            torch.set_num_threads(cpu_threads)
        backend = backend_class(config.backend, self.device)  # said before the (long) load
        print(f"sampler {self.name}: {backend.name} backend (asked for {config.backend!r})", flush=True)
        if engine_share is not None and not backend.shares_engines:
            raise SamplerError(f"--sampler.clients_per_engine: the {backend.name} backend has no engine to share")
        # A pause for a sync lasts at most sync_timeout_s: a generate held by one gives up only well after.
        self.backend, self.fmt = backend.load(
            model_path,
            BackendOptions(
                self.device,
                seed,
                self.in_flight,
                resume_timeout_s=3 * sync_timeout_s,
                vllm=_vllm_options(config, vllm, engine_share),
                adapter=adapter,
                start_timeout_s=config.engine_start_timeout_s,
            ),
        )
        self.weights = WeightReceiving(
            self.backend.weight_sink,
            name=self.name,
            in_flight=self.in_flight,
            sync_timeout_s=sync_timeout_s,
            generating=lambda: self.generation.calls,  # made next: it waits behind this gate
        )
        self.generation = GatedGeneration(self.backend, self.weights)
        self.lengths = LengthProfile.parse(config.lengths)  # synthetic lengths (benchmarks), or None
        self._length_draws = random.Random(seed)
        self.sampling = SamplingParams(
            max_new_tokens=config.max_new_tokens
            or (self.lengths.cap if self.lengths else int(self.fmt.max_new_tokens_hint)),
            temperature=config.temperature,
            top_p=config.top_p,
            stop_token_ids=list(self.fmt.stop_token_ids),
        )
        start_phase(f"loading the task {task.name or task.reward}")
        self.task = load_task(task)
        self.problems = self.task.splits(data.data_seed, data.n_train, data.n_heldout).train
        self.heldout = HeldoutSet(task, data, built=self.task)  # the held-out evaluation's share (evaluate_heldout)
        self.agent = self.task if isinstance(self.task, Agent) else None
        # An agent's episodes all run at once, each one user call: a place for every one of the
        # batches in flight (the driver's paced streams, --sampler.streams).
        batches = max(1, config.streams)
        workers = max(16, batches * self.prompts_per_batch * self.group_size) if self.agent is not None else 16
        self.calls = UserCalls(self.task.task_name(), task.score_timeout_s, task.max_failure_rate, workers=workers)
        self.max_context = _positions(model_path)
        self.endpoint: OpenAIServer | None = None  # started on first use: an agent's rollouts, openai_endpoint
        self.runner = EpisodeRunner(
            self.task, self.fmt, self.calls, max_turns=0 if self.agent else task.max_turns, max_context=self.max_context
        )
        self._order = shuffled_walk(len(self.problems), seed)  # counted once restore_data_state installs one
        self._prompt_ids: dict[int, list[int]] = {}
        self._groups = 0  # yielded (the batches' counters are `generation`'s, the syncs' `weights`')

    # --- weight sync: `WeightReceiving`'s (each documented on the method it forwards to; the
    # group's own endpoints, sync_listen/join/leave/created, are `SyncEndpoints`' over it) ---------

    @property
    def sync_side(self) -> SyncSide:
        return self.weights

    @endpoint
    async def setup_receiver(self, timeout_s: float = 60.0) -> int:
        return await self.weights.setup(timeout_s)

    @endpoint
    async def receive_weights(self, version: int) -> SamplerSyncStats:
        stats = await self.weights.receive(version)
        window = self.backend.take_engine_window()
        if window is None:
            return stats
        return msgspec.structs.replace(stats, preemptions=window[0], kv_cache_peak=window[1])

    @endpoint
    async def weights_digest(self) -> str:
        return await self.weights.digest()

    # --- rollouts, generation and evaluation --------------------------------------------------------

    @endpoint
    async def rollouts(self, max_groups: int = 0) -> AsyncIterator[RolloutGroup]:
        """One scored group per problem, ``max_groups`` of them (0: until the caller stops). A
        consumer that stops reading pauses generation (the stream's credit window). Problems are
        run ``prompts_per_batch`` at a time; where the backend decodes concurrent calls together
        (`SamplerBackend.batches_requests`), each problem is a call of its own and its group is
        yielded as soon as it ends, so no group waits for a longer one of its batch. A group's
        ``generate_s`` is the wall time of its call(s), ``version`` the oldest weight version any
        of its tokens was sampled under (``version_spans``: which tokens each version sampled)."""
        produced = 0
        while max_groups <= 0 or produced < max_groups:
            count = self.prompts_per_batch if max_groups <= 0 else min(self.prompts_per_batch, max_groups - produced)
            indices = [next(self._order) for _ in range(count)]
            if self.agent is not None:
                batches = self._agent_rollouts(indices)
            elif self.backend.batches_requests:
                batches = self._each_as_it_ends(indices)
            else:
                batches = self._problems(indices)
            async for group in batches:
                # under these weights it is done: a group that ended early in a batch that ran
                # on under newer ones is as fresh as the batch (the queue counts from here)
                yield msgspec.structs.replace(group, delivered_version=self.weights.version)
                self._groups += 1
                produced += 1

    async def _problems(self, indices: list[int]) -> AsyncIterator[RolloutGroup]:
        """The groups of ``indices``' problems, generated in one batch, yielded once all have ended."""
        for group in await self._generated(indices):
            yield group

    async def _generated(self, indices: list[int]) -> list[RolloutGroup]:
        """The groups of ``indices``' problems, generated together: each tagged with the oldest
        version its calls began under and the seconds they took."""
        prompts = [self._prompt(i) for i in indices]
        versions: list[int] = []
        spent = [0.0]

        async def generate(prompt_ids: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
            version, groups, seconds = await self.generation(prompt_ids, n, self._forced(params, len(prompt_ids) * n))
            versions.append(version)
            spent[0] += seconds
            return groups

        groups = await self.runner.run(
            [self.problems[i] for i in indices], self.group_size, self.sampling, generate, prompt_ids=prompts
        )
        self.calls.check()  # too many failed score/step calls: TaskFailureError ends the stream
        finished = time.time()
        return [
            rollout_group(self.name, index, prompt, samples, min(versions), spent[0], finished)
            for index, prompt, samples in zip(indices, prompts, groups)
        ]

    async def _each_as_it_ends(self, indices: list[int]) -> AsyncIterator[RolloutGroup]:
        """The groups of ``indices``' problems, each generated by calls of its own, yielded in the
        order they end. The first to fail cancels the rest and raises."""
        ended: asyncio.Queue[RolloutGroup] = asyncio.Queue()  # bounded by len(indices)
        runs = [asyncio.ensure_future(self._one_problem(i, ended)) for i in indices]
        try:
            for _ in indices:
                getting = asyncio.ensure_future(ended.get())
                while not getting.done():  # each run that succeeds puts one group: it comes, or a run fails
                    await asyncio.wait(
                        [getting, *(r for r in runs if not r.done())], return_when=asyncio.FIRST_COMPLETED
                    )
                    error = next(
                        (r.exception() for r in runs if r.done() and not r.cancelled() and r.exception()), None
                    )
                    if error is not None and not getting.done():
                        getting.cancel()
                        raise error
                yield getting.result()
        finally:
            for r in runs:
                r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

    def _forced(self, params: SamplingParams, rows: int) -> SamplingParams:
        """``params`` with each row's exact length drawn from ``--sampler.lengths`` (within the
        call's ``max_new_tokens``), or as they are without a profile."""
        if self.lengths is None:
            return params
        cap = params.max_new_tokens
        lengths = [min(cap, self.lengths.draw(self._length_draws)) for _ in range(rows)]
        return msgspec.structs.replace(params, exact_lengths=lengths)

    async def _one_problem(self, index: int, ended: asyncio.Queue[RolloutGroup]) -> None:
        [group] = await self._generated([index])
        ended.put_nowait(group)

    @endpoint
    async def openai_endpoint(self) -> dict[str, str]:
        """Serve the OpenAI API on this sampler (started on first call; an agent's run starts it
        itself): ``base_url`` (127.0.0.1, ``.../v1``) and ``token``, the bearer key it requires.
        Requests at this root are served and recorded nowhere (docs/agents.md)."""
        server = await self._endpoint()
        return {"base_url": server.base_url(), "token": server.token}

    @endpoint
    async def generate(
        self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None
    ) -> list[list[Completion]]:
        """Raw completions from the backend, for evaluation and tests (not counted in stats)."""
        return await self.generation.raw(prompts, n, params or self.sampling)

    @endpoint
    async def evaluate_heldout(
        self, greedy: list[int], sampled: list[int], samples: int = 4, max_new_tokens: int = 0, rows: int = 64
    ) -> AsyncIterator[HeldoutPart]:
        """The run's held-out problems ``greedy`` (indices into the held-out split) greedily and
        ``sampled`` with ``samples`` completions each at the sampling temperature (no top-p, as
        the trainer's evaluation), through this sampler's engine beside its rollouts: vLLM batches
        both (every part at once), the HF backend runs one batch at a time, in turn (a part at a
        time). One `HeldoutPart` per part of about ``rows`` sequences as it ends, tagged with the
        weight versions its generation ran under (the driver checks them). Not counted in the
        rollout stats. ``max_new_tokens`` 0: the format's hint. The task's calls run under one
        failure budget for all of this sampler's evaluations: past it, `TaskFailureError`."""
        seen: set[int] = set()

        async def generate(prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
            version, groups, _ = await self.generation(prompts, n, params, counted=False)
            seen.update((version, self.weights.version))  # when it began, and now: a sync in between shows
            return groups

        parts: asyncio.Queue = asyncio.Queue()  # bounded by the parts of the call
        ended = object()
        solving = asyncio.ensure_future(
            self.heldout.solve(
                generate,
                self.fmt,
                greedy=greedy,
                sampled=sampled,
                samples=samples,
                max_new_tokens=max_new_tokens or int(self.fmt.max_new_tokens_hint),
                temperature=self.sampling.temperature,
                max_context=self.max_context,
                rows=rows,
                at_once=EVAL_PARTS_AT_ONCE if self.backend.batches_requests else 1,
                versions=lambda: sorted(seen),
                on_part=parts.put_nowait,
            )
        )
        solving.add_done_callback(lambda _: parts.put_nowait(ended))
        try:
            # No deadline of its own: the parts end with the generation's and the task's calls'
            # deadlines, and the driver's deadline on each item cancels the call.
            while (part := await parts.get()) is not ended:
                yield part
            solving.result()  # its error, once every part it finished is out
        finally:
            if not solving.done():
                solving.cancel()
                await asyncio.gather(solving, return_exceptions=True)

    @endpoint
    async def stats(self) -> SamplerStats:
        """Counters since start and what the sampler runs on (`SamplerStats`)."""
        s = {"groups": self._groups} | self.generation.counts | self.weights.counts | self.backend.engine_stats()
        backend = self.backend
        now = {
            "loaded_adapters": backend.loaded_adapters(),
            "version": self.weights.version,
            "generating": self.generation.calls,
            "decoded": backend.tokens_decoded(),
            "name": self.name,
            "backend": backend.name,
            "device": str(self.device),
            "weight_dtype": self.weights.sink.weight_dtype,
            "tokens_per_s": s["tokens"] / s["generate_s"] if s["generate_s"] > 0 else 0.0,
            "serves_evaluations": backend.batches_requests and self.device.type == "cuda",
            "batches_requests": backend.batches_requests,
            "digestible": type(backend).digestible_on(self.device),
        }
        return msgspec.convert(s | now, SamplerStats)  # each counter checked against its field's type

    # --- resume and fault-tolerance hooks (asyncrl/rl/checkpoint.py, driver/fleet/pool.py) ------------

    @endpoint
    async def data_state(self) -> SamplerDataState:
        """Prompts drawn from the data walk so far and the sampling RNG, for a checkpoint
        (the walk is counted once `restore_data_state` has installed it; -1 before)."""
        generator = self.backend.generator  # None: the engine's own RNG, reseeded on a restart only
        return SamplerDataState(
            seed=getattr(self._order, "seed", -1),
            drawn=getattr(self._order, "drawn", -1),
            generator=bytes(generator.get_state().numpy()) if generator is not None else b"",
        )

    @endpoint
    async def restore_data_state(self, state: SamplerDataState) -> None:
        """Continue the walk of ``state.seed`` after ``state.drawn`` prompts, and set (or reseed)
        the sampling RNG. Before the first rollout only: a walk half-consumed by a stream would
        be skipped ahead under it."""
        self._order = CountedWalk(shuffled_walk(len(self.problems), state.seed), state.drawn, state.seed)
        generator = self.backend.generator
        if generator is not None and state.generator:
            generator.set_state(torch.frombuffer(bytearray(state.generator), dtype=torch.uint8))
        elif generator is not None and state.generator_seed >= 0:
            generator.manual_seed(state.generator_seed)

    async def on_start(self) -> None:
        # What the engine compiles on its first generates (`SamplerBackend.warm_up`: vLLM's
        # sampling ops), done here, before this sampler is up, so no weight sync it joins waits
        # for it: a sync takes the weights between engine steps, and the whole group waited out
        # those first steps (6-16 s for the first syncs after a scale-up).
        await self.backend.warm_up(list(self.fmt.render_ids(as_prompt("warm up"))), self.sampling)

    async def on_stop(self) -> None:
        engine = self.backend.engine_stats()
        if "preemptions" in engine:  # --sampler.engine_stats: what the run asked of the KV cache
            print(
                f"sampler {self.name}: engine preemptions {engine['preemptions']}, KV cache peak "
                f"{100 * engine['kv_cache_peak']:.0f}% of {engine.get('kv_cache_tokens', 0)} tokens",
                flush=True,
            )
        try:  # an engine that receives weights drops its communicator while it still can
            async with timeout(10.0):
                await self.weights.leave()
        except Exception as exc:  # a dead or stuck engine: close() below ends it all the same
            print(f"sampler {self.name}: leaving the weight-sync group on stop failed: {exc!r}", flush=True)
        if self.endpoint is not None:
            await self.endpoint.close()
        self.backend.close()
        self.calls.close()
        self.heldout.close()
        await self.weights.leave()  # idempotent: what is left of the seat after a failed leave above

    # --- helpers --------------------------------------------------------------------------------

    def _prompt(self, index: int) -> list[int]:
        ids = self._prompt_ids.get(index)
        if ids is None:
            try:
                prompt = as_prompt(self.task.prompt(self.problems[index]))
                ids = list(self.fmt.render_ids(prompt))
            except Exception as exc:  # the task's own code, on its own data: a bug to fix, not to count
                raise TaskFailureError(
                    f"task {self.task.task_name()}: prompt() of train problem {index} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not ids:
                raise TaskFailureError(
                    f"task {self.task.task_name()}: train problem {index} renders as an empty prompt"
                )
            self._prompt_ids[index] = ids
        return ids

    async def _endpoint(self) -> OpenAIServer:
        if self.endpoint is None:

            async def generate(prompts: list[list[int]], n: int, params: SamplingParams, progress=None):
                version, groups, _ = await self.generation(prompts, n, params, progress)
                return version, groups

            # vLLM batches concurrent requests itself; the HF backend runs one batch at a time.
            server = OpenAIServer(
                generate,
                self.fmt.tokenizer,
                self.sampling,
                max_context=self.max_context,
                batch=not self.backend.batches_requests,
                max_calls=self.agent.max_calls if self.agent is not None else 32,
            )
            await server.start()
            self.endpoint = server
            print(
                f"sampler {self.name}: OpenAI endpoint at {server.base_url()} (its token, for code outside "
                "the episodes: asyncrl status RUN_DIR --endpoint)",
                flush=True,
            )
        return self.endpoint

    async def _agent_rollouts(self, indices: list[int]) -> AsyncIterator[RolloutGroup]:
        """One batch of an agent's problems: ``group_size`` episodes each, all at once."""
        runner = AgentRunner(cast(Agent, self.agent), await self._endpoint(), self.calls)  # an agent's task only
        start = time.perf_counter()
        groups = await runner.run([self.problems[i] for i in indices], self.group_size)
        self.calls.check()  # too many failed episodes: TaskFailureError ends the stream
        seconds, finished = time.perf_counter() - start, time.time()
        for index, group in zip(indices, groups):
            if group is not None:  # no episode of it called the model: nothing to train on
                yield rollout_group(self.name, index, group.prompt_ids, group.samples, group.version, seconds, finished)


def _vllm_options(config: SamplerConfig, extra: dict | None, share: EngineShare | None) -> dict:
    """`VLLMBackend`'s keyword arguments: the sampler section's, the spawner's ``extra`` ones
    (``SamplerActor``'s ``vllm``), ``--sampler.vllm_args``' engine fields, and its engine ``share``."""
    return (
        {"stage_weights": config.stage_weights, "engine_stats": config.keeps_engine_stats}
        | (extra or {})
        | ({"engine": config.engine_args()} if config.vllm_args else {})
        | ({"share": share} if share is not None else {})
    )


def _positions(model_path: str) -> int:
    """The checkpoint's positions (``max_position_embeddings`` of its config.json; 0: unknown),
    which an episode's whole context must fit in."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError):
        return 0
