"""Sampler backends side by side: our vLLM sampler actor, bare vLLM and our Hugging Face backend, on
the same model, prompts and sampling.

`hf` and `vllm` run in a real `SamplerActor` (as in GRPO), next to a trainer stand-in that sends
it the model's weights over gloo from the CPU (on one GPU NCCL cannot give two ranks one device).
`CHILD_BACKENDS` run in a child process each, with the engine arguments our backend uses
(`engine_args`, less the worker extension): `vllm-bare` is vLLM's own ``LLM`` class, what vLLM
does alone; the others split our actor's cost into its parts. Measured per backend and batch:

* start: seconds from spawn to a ready actor (the vLLM engine included), or to a ready engine;
* tokens/s: completion tokens over wall time of ``--reps`` timed ``generate`` calls of
  PROMPTS Countdown prompts x ``--n`` samples x TOKENS (``--batches PROMPTSxTOKENS,...``; no stop
  token, so every completion has that length), after one warm-up call. Temperature 1, top-p 1,
  the sampled token's log-prob returned (bare vLLM: flat as our backend asks, vLLM's default
  per-token dicts, or none: ``--bare-logprobs``), no seed (GRPO's sampler sets none);
* weight update: median and min seconds of ``--syncs`` ``receive_weights`` calls (pause mode,
  nothing in flight), from the sampler's side: transfer and load (for vLLM into its worker
  process, prefix-cache reset included), sent in the sampler's dtype (HF: fp32).

    python benchmarks/sampler_backends.py                      # CPU, the embedded model's shape
    python benchmarks/sampler_backends.py --model-path DIR     # any local checkpoint
    python benchmarks/sampler_backends.py --device cuda --shape 0.5b --dtype bfloat16 \
        --backends vllm,vllm-bare,hf --batches 512x256,64x256 --n 1       # one GPU

``--profile DIR`` records each backend's first batch with py-spy (collapsed stacks, all processes).
Every process gets ``--threads`` OpenMP threads (1 by default, as GRPO's actors on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from asyncrl import Supervisor, endpoint
from asyncrl.comm.member import SyncMember, form_group

HOST = "127.0.0.1"
SHAPES = {  # hidden, layers, attention heads, kv heads, intermediate, vocab (0: the tokenizer's)
    "embedded": (128, 4, 4, 2, 512, 0),
    "0.5b": (896, 24, 14, 2, 4864, 151936),  # Qwen2-0.5B; tied embeddings: 494M parameters, 942 MiB in bf16
    "1.5b": (1536, 28, 12, 2, 8960, 151936),  # Qwen2-1.5B; tied embeddings: 1.54B parameters
    "7b": (3584, 28, 28, 4, 18944, 152064),  # Qwen2-7B; its own output layer: 7.6B parameters
}
UNTIED = {(3584, 28, 28, 4, 18944, 152064)}  # shapes whose output layer is not the embedding (as the real models)
N_TRAIN = 2000  # Countdown problems to draw prompts from (the largest batch must fit)


class Sender(SyncMember):
    """Trainer stand-in: the checkpoint's weights in ``dtype`` on the CPU, sent as they are."""

    def __init__(self, model_path: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=getattr(torch, dtype))
        self.state = dict(model.named_parameters())
        self.sender = None

    @endpoint
    async def setup(self, timeout_s: float = 60.0) -> list[int]:
        """[parameters, bytes] of one sync."""
        from asyncrl.comm.weights import WeightSender

        self.sender = await asyncio.to_thread(
            WeightSender.create, self.sync_comm, self.sync_group, self.state, timeout_s=timeout_s
        )
        return [sum(t.numel() for t in self.state.values()), sum(t.nbytes for t in self.state.values())]

    @endpoint
    async def send(self, version: int) -> float:
        return (await asyncio.to_thread(self.sender.send, version)).seconds


def make_model(path: str, shape: tuple[int, ...], dtype: str, positions: int = 1024) -> None:
    """A random Qwen2 of ``shape`` (`SHAPES`) in ``dtype`` with ``positions`` positions, with the
    embedded model's byte-level tokenizer (a larger vocabulary only has ids that no prompt uses)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer

    hidden, layers, heads, kv_heads, intermediate, vocab = shape
    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab or len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=positions,
        tie_word_embeddings=shape not in UNTIED,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    # Built on the GPU where there is one, in the target dtype: a 7B model's random init in fp32 on
    # the CPU takes minutes and 30 GB.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump({"prompt_style": "compact", "max_new_tokens_hint": 64}, f)


def batches(text: str) -> list[tuple[int, int]]:
    """``"512x256,64x256"`` -> [(512, 256), (64, 256)]: prompts x new tokens."""
    try:
        out = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(b) != 2 or min(b) < 1 for b in out):
        raise argparse.ArgumentTypeError(f"--batches wants PROMPTSxTOKENS[,...], e.g. 512x256, not {text!r}")
    return out


def prompt_ids(model_path: str, count: int) -> list[list[int]]:
    from asyncrl.rl.model.policy import load_prompt_format
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout

    _, fmt = load_prompt_format(model_path)
    train, _ = train_and_heldout(0, N_TRAIN, 10)
    task = Countdown()
    return [fmt.render_ids(task.prompt(p)) for p in train[:count]]


def process_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment every measured process gets (bare vLLM's too): ``--threads`` OpenMP threads;
    on CPU vLLM's KV cache and unpinned threads as in the tests."""
    return {
        "OMP_NUM_THREADS": str(args.threads),
        "TQDM_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def vllm_options(args: argparse.Namespace) -> dict:
    """`VLLMBackend` keyword arguments, the same for our actor and for bare vLLM."""
    return {"engine": {"max_model_len": 1024}, "gpu_memory_utilization": args.gpu_memory_utilization}


class Profile:
    """``py-spy record`` of process ``pid`` and of vLLM's processes below it (engine core, workers)
    while in the ``with`` block: collapsed stacks in ``folder``/``name``-PID.txt, for a flame graph
    or a grep. Nothing when ``folder`` is ""."""

    def __init__(self, folder: str, pid: int, name: str):
        self.folder, self.pid, self.name = folder, pid, name
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Profile:
        if self.folder:
            os.makedirs(self.folder, exist_ok=True)
            for pid in [self.pid, *vllm_processes_below(self.pid)]:
                self.procs.append(
                    subprocess.Popen(
                        [
                            shutil.which("py-spy") or "py-spy",
                            "record",
                            "--pid",
                            str(pid),
                            "--nonblocking",
                            "--rate",
                            "200",
                            "--format",
                            "raw",
                            "--output",
                            os.path.join(self.folder, f"{self.name}-{pid}.txt"),
                        ],
                        stdout=subprocess.DEVNULL,
                    )
                )
            time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def vllm_processes_below(pid: int) -> list[int]:
    """vLLM's processes below ``pid`` (their command lines read "VLLM::EngineCore", "VLLM::Worker"...)."""
    parents, found = {}, []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier}
        for p in frontier:
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if f.read().startswith(b"VLLM::"):
                        found.append(p)
            except OSError:
                continue
    return sorted(found)


async def measure_actor(backend: str, model_path: str, args: argparse.Namespace) -> list[dict]:
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.generation import SamplingParams
    from asyncrl.rl.sampler.actor import SamplerActor

    env = process_env(args)
    cuda = args.device == "cuda"
    rows = []
    async with Supervisor(call_timeout_s=900, start_timeout_s=600) as sup:
        start = time.perf_counter()
        config = SamplerConfig(backend=backend, weight_update="pause")
        name = f"sampler-{backend}"
        sampler = await sup.spawn(
            SamplerActor,
            model_path,
            config,
            name=name,
            env=env,
            gpus=int(cuda),
            kwargs=dict(data=DataConfig(n_train=N_TRAIN, n_heldout=10), device=args.device, vllm=vllm_options(args)),
        )
        started = time.perf_counter() - start
        pid = next(s.pid for s in sup.status() if s.name == name)
        for i, (prompts, tokens) in enumerate(args.batches):
            ids = prompt_ids(model_path, prompts)
            params = SamplingParams(max_new_tokens=tokens, temperature=1.0, top_p=1.0, stop_token_ids=[])
            await sampler.generate(ids, args.n, params)  # warm-up
            with Profile(args.profile if i == 0 else "", pid, f"{backend}-{prompts}x{tokens}"):
                timing = await timed(functools.partial(sampler.generate, ids, args.n, params), args.reps)
            rows.append(
                {"backend": backend, "start_s": started, "prompts": prompts, "max_new_tokens": tokens, **timing}
            )
            print(json.dumps(rows[-1]), flush=True)
        if args.syncs:
            try:
                sync = await measure_syncs(sup, sampler, backend, model_path, env, args)
            except Exception as exc:  # keep the generation numbers
                traceback.print_exc()
                sync = {"sync_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            for row in rows:
                row.update(sync)
    return rows


async def measure_syncs(sup, sampler, backend: str, model_path: str, env: dict, args: argparse.Namespace) -> dict:
    dtype = "float32" if backend == "hf" else args.dtype  # the sampler's own: HF loads fp32
    sender = await sup.spawn(Sender, model_path, dtype, name="sender", env=env)
    await form_group([sender, sampler], HOST, backend="gloo", timeout_s=300)
    (params, nbytes), _ = await asyncio.gather(sender.setup(300.0), sampler.setup_receiver(300))
    syncs = []
    for version in range(1, args.syncs + 1):
        _, took = await asyncio.gather(sender.send(version), sampler.receive_weights(version))
        syncs.append(took.seconds)
    return {"sync_s": statistics.median(syncs), "sync_min_s": min(syncs), "sync_bytes": nbytes, "params": params}


async def timed(generate, reps: int) -> dict:
    """``reps`` calls of ``generate()`` (a coroutine function returning groups of completions)."""
    count, seconds = 0, 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = await generate()
        seconds += time.perf_counter() - t0
        count += sum(len(c.token_ids) for g in out for c in g)
    return {"tokens": count, "tokens_per_s": count / seconds, "generate_s": seconds / reps}


CHILD_BACKENDS = ("vllm-bare", "vllm-async-bare", "vllm-backend")
"""Run in a child process of their own (their engine and GPU memory go with it): bare vLLM's
``LLM``; its ``AsyncLLM`` driven as our backend drives it (a request per prompt, final output
only, flat log-probs), without our code; our `VLLMBackend` without the actor around it."""


def measure_child(backend: str, model_path: str, args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, model_path, *sys.argv[1:]]
    done = subprocess.run(
        cmd, stdout=subprocess.PIPE, text=True, timeout=args.child_timeout_s, env=os.environ | process_env(args)
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"{backend} exited with {done.returncode} (its log is on stderr above)")
    return rows


def child(backend: str, model_path: str, args: argparse.Namespace) -> None:
    """One of `CHILD_BACKENDS` on ``model_path``; a JSON row per batch (and log-prob mode) on stdout."""
    import torch

    from asyncrl.rl.sampler.vllm import compat
    from asyncrl.rl.sampler.vllm.engine_setup import engine_args

    compat.environ_defaults(compat.engine_environment(args.device))  # as VLLMBackend does
    options = vllm_options(args)
    engine = engine_args(
        model_path,
        device=torch.device(args.device),
        seed=0,
        gpu_memory_utilization=options["gpu_memory_utilization"],
        engine=options["engine"],
    )
    engine.pop("worker_extension_cls")
    if backend == "vllm-bare":
        bare_llm(engine, model_path, args)
    else:
        from asyncrl.runtime.loop import run

        run(async_child(backend, engine, model_path, args))


def bare_llm(engine: dict, model_path: str, args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**engine)
    started = time.perf_counter() - start
    modes = {
        "flat": ("vllm-bare", True),
        "dicts": ("vllm-bare, per-token log-prob dicts", False),
        "none": ("vllm-bare, no log-probs", False),
    }
    for i, (prompts, tokens) in enumerate(args.batches):
        ids = [{"prompt_token_ids": p} for p in prompt_ids(model_path, prompts)]
        for mode in args.bare_logprobs.split(","):
            label, flat = modes[mode]
            params = SamplingParams(
                n=args.n,
                temperature=1.0,
                top_p=1.0,
                max_tokens=tokens,
                ignore_eos=True,
                stop_token_ids=[],
                logprobs=None if mode == "none" else 0,
                flat_logprobs=flat,
                detokenize=False,
            )
            llm.generate(ids, params, use_tqdm=False)  # warm-up
            count, seconds = 0, 0.0
            profile = args.profile if i == 0 and mode == "flat" else ""
            with Profile(profile, os.getpid(), f"{label}-{prompts}x{tokens}"):
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    out = llm.generate(ids, params, use_tqdm=False)
                    seconds += time.perf_counter() - t0
                    count += sum(len(c.token_ids) for o in out for c in o.outputs)
            print(
                json.dumps(
                    {
                        "backend": label,
                        "start_s": started,
                        "prompts": prompts,
                        "max_new_tokens": tokens,
                        "tokens": count,
                        "tokens_per_s": count / seconds,
                        "generate_s": seconds / args.reps,
                    }
                ),
                flush=True,
            )


async def async_child(backend: str, engine: dict, model_path: str, args: argparse.Namespace) -> None:
    from asyncrl.rl.generation import SamplingParams
    from asyncrl.rl.model.policy import load_prompt_format
    from asyncrl.rl.sampler.vllm import compat
    from asyncrl.rl.sampler.vllm.backend import VLLMBackend

    start = time.perf_counter()
    if backend == "vllm-async-bare":
        llm = compat.make_engine(engine)

        async def one(request_id: str, prompt: list[int], params) -> list:
            async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id):
                final = out
            return final.outputs

        def generate(ids: list[list[int]], tokens: int):
            params = compat.sampling_params(
                n=args.n,
                temperature=1.0,
                top_p=1.0,
                max_tokens=tokens,
                ignore_eos=True,
                stop_token_ids=[],
                logprobs=0,
                detokenize=False,
            )
            return asyncio.gather(*(one(f"r{next(counter)}", p, params) for p in ids))
    else:
        tokenizer, _ = load_prompt_format(model_path)
        llm = VLLMBackend(model_path, tokenizer=tokenizer, device=args.device, **vllm_options(args))

        def generate(ids: list[list[int]], tokens: int):
            return llm.generate(
                ids, args.n, SamplingParams(max_new_tokens=tokens, temperature=1.0, top_p=1.0, stop_token_ids=[])
            )

    counter = itertools.count()
    started = time.perf_counter() - start
    try:
        for i, (prompts, tokens) in enumerate(args.batches):
            ids = prompt_ids(model_path, prompts)
            await generate(ids, tokens)  # warm-up
            with Profile(args.profile if i == 0 else "", os.getpid(), f"{backend}-{prompts}x{tokens}"):
                timing = await timed(functools.partial(generate, ids, tokens), args.reps)
            print(
                json.dumps(
                    {"backend": backend, "start_s": started, "prompts": prompts, "max_new_tokens": tokens, **timing}
                ),
                flush=True,
            )
    finally:
        (llm.shutdown if backend == "vllm-async-bare" else llm.close)()


def table(rows: list[dict], args: argparse.Namespace, about: str) -> str:
    runs: dict[tuple[int, int], list[float]] = {}  # bare vLLM's runs per batch: the mean is the reference
    for r in rows:
        if r.get("backend") == "vllm-bare" and "error" not in r:
            runs.setdefault((r["prompts"], r["max_new_tokens"]), []).append(r["tokens_per_s"])
    bare = {batch: statistics.mean(values) for batch, values in runs.items()}
    lines = [
        f"{about}; n={args.n}, temperature 1, {args.reps} timed call(s) after a warm-up",
        "",
        "| backend | batch (prompts x tokens) | start s | tokens/s | vs bare vLLM | s per generate | "
        "weight update, median (min) | sent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error']} | | | | | | |")
            continue
        ref = bare.get((r["prompts"], r["max_new_tokens"]))
        ratio = f"{r['tokens_per_s'] / ref:.0%}" if ref else ""
        sync = (
            f"{r['sync_s'] * 1000:.1f} ms ({r['sync_min_s'] * 1000:.1f})"
            if "sync_s" in r
            else f"failed: {r['sync_error']}"
            if "sync_error" in r
            else ""
        )
        sent = f"{r['sync_bytes'] / 2**20:.0f} MiB" if "sync_bytes" in r else ""
        lines.append(
            f"| {r['backend']} | {r['prompts']} x {r['max_new_tokens']} | {r['start_s']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {ratio} | {r['generate_s']:.2f} | {sync} | {sent} |"
        )
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="hf,vllm", help=f"of hf, vllm (our actors), {', '.join(CHILD_BACKENDS)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model-path", default="")
    parser.add_argument("--shape", default="embedded", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the checkpoint")
    parser.add_argument("--batches", type=batches, default=batches("16x64"))
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--child-timeout-s", type=float, default=900.0)
    parser.add_argument("--bare-logprobs", default="flat,dicts,none", help="vllm-bare's log-prob modes")
    parser.add_argument("--profile", default="", help="py-spy profiles of the first batch into this folder")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default="",
        metavar="FILE",
        help="print one JSON list instead of the table; with FILE, write it there (as it grows)",
    )
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path
        if not path:
            path = os.path.join(tmp, "model")
            make_model(path, SHAPES[args.shape], args.dtype)
        for backend in args.backends.split(","):
            try:
                rows += (
                    measure_child(backend, path, args)
                    if backend in CHILD_BACKENDS
                    else await measure_actor(backend, path, args)
                )
            except Exception as exc:  # one backend's failure must not lose the others' numbers
                traceback.print_exc()
                rows.append({"backend": backend, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            if args.json not in ("", "-"):
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    about = f"{args.model_path or args.shape + ' shape, random ' + args.dtype} on {args.device}"
    print(json.dumps(rows) if args.json == "-" else table(rows, args, about))


if __name__ == "__main__":  # vLLM starts its engine with spawn once CUDA is up: the guard is needed
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], parse(sys.argv[4:]))
    else:
        sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
