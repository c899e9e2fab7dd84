"""Sampler backends side by side: vLLM against Hugging Face on the same model, prompts and sampling.

Each backend runs in a real `SamplerActor` (as in GRPO), next to a trainer stand-in that sends it
the model's weights over the weight-sync plane (gloo on CPU). Measured per backend, in one run:

* start: seconds from spawn to a ready actor (the vLLM engine included);
* tokens/s: completion tokens over wall time of ``--reps`` timed ``generate`` calls of
  ``--prompts`` Countdown prompts x ``--n`` samples x ``--max-new-tokens`` (no stop token, so
  every completion has that length), after one warm-up call;
* weight update: median seconds of ``--syncs`` ``receive_weights`` calls (pause mode, nothing in
  flight), from the sampler's side: the transfer and the load into the model (for vLLM: into its
  worker process, prefix-cache reset included).

    python benchmarks/sampler_backends.py                      # the embedded model's shape, random weights
    python benchmarks/sampler_backends.py --backends hf        # one backend only
    python benchmarks/sampler_backends.py --model-path DIR     # any local checkpoint

Every process gets ``--threads`` OpenMP threads (1 by default, as GRPO's actors on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from asyncrl import Supervisor, endpoint
from asyncrl.comm.member import SyncMember, form_group

HOST = "127.0.0.1"


class Sender(SyncMember):
    """Trainer stand-in: the checkpoint's weights, sent as they are (named_parameters)."""

    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.state = dict(model.named_parameters())
        self.sender = None

    @endpoint
    async def setup(self, timeout_s: float = 60.0) -> int:
        from asyncrl.comm.weights import WeightSender

        self.sender = await asyncio.to_thread(WeightSender.create, self.sync_comm, self.sync_group, self.state,
                                              timeout_s=timeout_s)
        return sum(t.numel() for t in self.state.values())

    @endpoint
    async def send(self, version: int) -> float:
        return (await asyncio.to_thread(self.sender.send, version)).seconds


def make_model(path: str, hidden: int, layers: int, heads: int) -> None:
    """A random Qwen2 of the embedded model's kind (byte-level tokenizer, head_dim = hidden/heads)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), intermediate_size=4 * hidden,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump({"prompt_style": "compact", "max_new_tokens_hint": 64}, f)


async def measure(backend: str, model_path: str, args: argparse.Namespace) -> dict:
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.model.policy import load_prompt_format
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.sampler.backend import SamplingParams
    from asyncrl.rl.tasks.countdown import Countdown, train_and_heldout

    env = {"OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    _, fmt = load_prompt_format(model_path)
    train, _ = train_and_heldout(0, 200, 10)
    prompts = [fmt.render_ids(Countdown().prompt(p)) for p in train[:args.prompts]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=[], seed=0)
    async with Supervisor(call_timeout_s=600, start_timeout_s=300) as sup:
        start = time.perf_counter()
        config = SamplerConfig(backend=backend, weight_update="pause")
        sampler = await sup.spawn(SamplerActor, model_path, config, name=f"sampler-{backend}", env=env, kwargs=dict(
            data=DataConfig(n_train=200, n_heldout=10), vllm={"engine": {"max_model_len": 1024}}))
        started = time.perf_counter() - start
        sender = await sup.spawn(Sender, model_path, name="sender", env=env)
        await form_group([sender, sampler], HOST, timeout_s=120)
        params_count, _ = await asyncio.gather(sender.setup(), sampler.setup_receiver(120))
        await sampler.generate(prompts, args.n, params)  # warm-up
        tokens, seconds = 0, 0.0
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = await sampler.generate(prompts, args.n, params)
            seconds += time.perf_counter() - t0
            tokens += sum(len(c.token_ids) for g in out for c in g)
        syncs = []
        for version in range(1, args.syncs + 1):
            _, took = await asyncio.gather(sender.send(version), sampler.receive_weights(version))
            syncs.append(took)
    return {"backend": backend, "start_s": started, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "generate_s": seconds / args.reps, "sync_s": statistics.median(syncs), "sync_min_s": min(syncs),
            "params": params_count}


def table(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"{args.prompts} prompts x n={args.n} x {args.max_new_tokens} tokens, temperature 1, "
             f"{args.threads} thread(s) per process; {results[0]['params'] / 1e6:.2f}M parameters",
             "", "| backend | start s | tokens/s | s per generate | weight update s (median) | min |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['backend']} | {r['start_s']:.1f} | {r['tokens_per_s']:.0f} | {r['generate_s']:.2f} | "
                     f"{r['sync_s'] * 1000:.1f} ms | {r['sync_min_s'] * 1000:.1f} ms |")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--model-path", default="")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path
        if not path:
            path = os.path.join(tmp, "model")
            make_model(path, args.hidden, args.layers, args.heads)
        results = [await measure(b, path, args) for b in args.backends.split(",")]
    print(json.dumps(results) if args.json else table(results, args))


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
