"""Sampler backends side by side: our vLLM sampler actor, bare vLLM and our Hugging Face backend, on
the same model, prompts and sampling.

`hf` and `vllm` run in a real `SamplerActor` (as in GRPO), next to a trainer stand-in that sends
it the model's weights over the weight-sync plane (gloo from the CPU: on one GPU NCCL cannot
give two ranks the same device). `vllm-bare` is vLLM's own ``LLM`` class in a child process, with
the engine arguments our backend uses (`engine_args`, less the worker extension): what vLLM
does alone. Measured per backend and batch, in one run:

* start: seconds from spawn to a ready actor (the vLLM engine included), or to a ready ``LLM``;
* tokens/s: completion tokens over wall time of ``--reps`` timed ``generate`` calls of
  PROMPTS Countdown prompts x ``--n`` samples x TOKENS (``--batches PROMPTSxTOKENS,...``; no stop
  token, so every completion has that length), after one warm-up call. Sampling: temperature 1,
  top-p 1, the sampled token's log-prob returned (bare vLLM: kept flat as our backend asks, in
  vLLM's default per-token dicts, and none), no seed (a seed per request is a slower sampler path
  in vLLM, and GRPO's sampler sets none);
* weight update: median and min seconds of ``--syncs`` ``receive_weights`` calls (pause mode,
  nothing in flight), from the sampler's side: the transfer and the load into the model (for
  vLLM: into its worker process, prefix-cache reset included). The sender sends in the sampler's
  dtype (HF: fp32; vLLM: the checkpoint's).

    python benchmarks/sampler_backends.py                      # CPU, the embedded model's shape
    python benchmarks/sampler_backends.py --backends hf        # one backend only
    python benchmarks/sampler_backends.py --model-path DIR     # any local checkpoint
    python benchmarks/sampler_backends.py --device cuda --shape 0.5b --dtype bfloat16 \\
        --backends vllm,vllm-bare,hf --batches 512x256,64x256 --n 1       # one GPU

Every process gets ``--threads`` OpenMP threads (1 by default, as GRPO's actors on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
}
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

        self.sender = await asyncio.to_thread(WeightSender.create, self.sync_comm, self.sync_group, self.state,
                                              timeout_s=timeout_s)
        return [sum(t.numel() for t in self.state.values()), sum(t.nbytes for t in self.state.values())]

    @endpoint
    async def send(self, version: int) -> float:
        return (await asyncio.to_thread(self.sender.send, version)).seconds


def make_model(path: str, shape: tuple[int, ...], dtype: str) -> None:
    """A random Qwen2 of ``shape`` (`SHAPES`) in ``dtype``, with the embedded model's byte-level
    tokenizer (a larger vocabulary only has ids that no prompt uses)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer

    hidden, layers, heads, kv_heads, intermediate, vocab = shape
    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab or len(tok), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
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
    from asyncrl.rl.tasks.countdown import train_and_heldout

    _, fmt = load_prompt_format(model_path)
    train, _ = train_and_heldout(0, N_TRAIN, 10)
    return [fmt.prompt_ids(p) for p in train[:count]]


def process_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment every measured process gets (bare vLLM's too): ``--threads`` OpenMP threads;
    on CPU vLLM's KV cache and unpinned threads as in the tests."""
    return {"OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def vllm_options(args: argparse.Namespace) -> dict:
    """`VLLMBackend` keyword arguments, the same for our actor and for bare vLLM."""
    return {"engine": {"max_model_len": 1024}, "gpu_memory_utilization": args.gpu_memory_utilization}


async def measure_actor(backend: str, model_path: str, args: argparse.Namespace) -> list[dict]:
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.sampler.backend import SamplingParams

    env = process_env(args)
    cuda = args.device == "cuda"
    rows = []
    async with Supervisor(call_timeout_s=900, start_timeout_s=600) as sup:
        start = time.perf_counter()
        config = SamplerConfig(backend=backend, weight_update="pause")
        sampler = await sup.spawn(SamplerActor, model_path, config, name=f"sampler-{backend}", env=env,
                                  gpus=int(cuda), kwargs=dict(data=DataConfig(n_train=N_TRAIN, n_heldout=10),
                                                              device=args.device, vllm=vllm_options(args)))
        started = time.perf_counter() - start
        for prompts, tokens in args.batches:
            rows.append({"backend": backend, "start_s": started, "prompts": prompts, "max_new_tokens": tokens,
                         **await timed(lambda p, sp: sampler.generate(p, args.n, sp), model_path, prompts, tokens,
                                       args, SamplingParams)})
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
        syncs.append(took)
    return {"sync_s": statistics.median(syncs), "sync_min_s": min(syncs), "sync_bytes": nbytes, "params": params}


async def timed(generate, model_path: str, prompts: int, tokens: int, args: argparse.Namespace, params_type) -> dict:
    ids = prompt_ids(model_path, prompts)
    params = params_type(max_new_tokens=tokens, temperature=1.0, top_p=1.0, stop_token_ids=[])
    await generate(ids, params)  # warm-up
    count, seconds = 0, 0.0
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = await generate(ids, params)
        seconds += time.perf_counter() - t0
        count += sum(len(c.token_ids) for g in out for c in g)
    return {"tokens": count, "tokens_per_s": count / seconds, "generate_s": seconds / args.reps}


def measure_bare(model_path: str, args: argparse.Namespace) -> list[dict]:
    """Bare vLLM in a child process (its engine and GPU memory go with it); rows on its stdout."""
    cmd = [sys.executable, os.path.abspath(__file__), "--bare-child", model_path, *sys.argv[1:]]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.bare_timeout_s,
                          env=os.environ | process_env(args))
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"bare vLLM exited with {done.returncode} (its log is on stderr above)")
    return rows


def bare_child(model_path: str, args: argparse.Namespace) -> None:
    """``vllm.LLM`` with `engine_args` (less the worker extension), the same prompts and sampling."""
    import torch
    from vllm import LLM, SamplingParams

    from asyncrl.rl.sampler.vllm import compat
    from asyncrl.rl.sampler.vllm.backend import engine_args

    compat.environ_defaults(compat.engine_environment(args.device))  # as VLLMBackend does
    options = vllm_options(args)
    engine = engine_args(model_path, device=torch.device(args.device), seed=0, max_model_len=0,
                         gpu_memory_utilization=options["gpu_memory_utilization"], engine=options["engine"])
    engine.pop("worker_extension_cls")
    start = time.perf_counter()
    llm = LLM(**engine)
    started = time.perf_counter() - start
    for prompts, tokens in args.batches:
        ids = [{"prompt_token_ids": p} for p in prompt_ids(model_path, prompts)]
        for label, logprobs, flat in (("vllm-bare", 0, True), ("vllm-bare, per-token log-prob dicts", 0, False),
                                      ("vllm-bare, no log-probs", None, False)):
            params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=tokens, ignore_eos=True,
                                    stop_token_ids=[], logprobs=logprobs, flat_logprobs=flat, detokenize=False)
            llm.generate(ids, params, use_tqdm=False)  # warm-up
            count, seconds = 0, 0.0
            for _ in range(args.reps):
                t0 = time.perf_counter()
                out = llm.generate(ids, params, use_tqdm=False)
                seconds += time.perf_counter() - t0
                count += sum(len(c.token_ids) for o in out for c in o.outputs)
            print(json.dumps({"backend": label, "start_s": started, "prompts": prompts, "max_new_tokens": tokens,
                              "tokens": count, "tokens_per_s": count / seconds, "generate_s": seconds / args.reps}),
                  flush=True)


def table(rows: list[dict], args: argparse.Namespace, about: str) -> str:
    bare = {(r["prompts"], r["max_new_tokens"]): r["tokens_per_s"] for r in rows if r.get("backend") == "vllm-bare"
            and "error" not in r}
    lines = [f"{about}; n={args.n}, temperature 1, {args.reps} timed call(s) after a warm-up", "",
             "| backend | batch (prompts x tokens) | start s | tokens/s | vs bare vLLM | s per generate | "
             "weight update, median (min) | sent |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error']} | | | | | | |")
            continue
        ref = bare.get((r["prompts"], r["max_new_tokens"]))
        ratio = f"{r['tokens_per_s'] / ref:.0%}" if ref else ""
        sync = (f"{r['sync_s'] * 1000:.1f} ms ({r['sync_min_s'] * 1000:.1f})" if "sync_s" in r
                else f"failed: {r['sync_error']}" if "sync_error" in r else "")
        sent = f"{r['sync_bytes'] / 2**20:.0f} MiB" if "sync_bytes" in r else ""
        lines.append(f"| {r['backend']} | {r['prompts']} x {r['max_new_tokens']} | {r['start_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {ratio} | {r['generate_s']:.2f} | {sync} | {sent} |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="hf,vllm", help="of hf, vllm (our actor), vllm-bare")
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
    parser.add_argument("--bare-timeout-s", type=float, default=900.0)
    parser.add_argument("--json", default="", help="also write the rows to this file")
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
                rows += measure_bare(path, args) if backend == "vllm-bare" else await measure_actor(backend, path, args)
            except Exception as exc:  # one backend's failure must not lose the others' numbers
                traceback.print_exc()
                rows.append({"backend": backend, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    about = f"{args.model_path or args.shape + ' shape, random ' + args.dtype} on {args.device}"
    print(table(rows, args, about))


if __name__ == "__main__":  # vLLM starts its engine with spawn once CUDA is up: the guard is needed
    if len(sys.argv) > 2 and sys.argv[1] == "--bare-child":
        bare_child(sys.argv[2], parse(sys.argv[3:]))
    else:
        sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
