"""What going through the OpenAI endpoint costs, against the direct path, on the same task.

The task: EPISODES two-turn conversations (a user question, the model's answer, a follow-up, the
model's second answer), TOKENS new tokens a turn, on the HF backend (one batch at a time, as a
CPU sampler runs), a random tiny Qwen2 with the project's byte-level tokenizer and a Qwen-style
chat template.

* direct: what an `Environment` episode costs the sampler: each turn of every episode in one
  ``backend.generate`` call, the second turn's prompt rendered by the template (as the agent's
  would be), the samples assembled from the ids;
* endpoint: the same conversations as agents (one `openai.AsyncOpenAI` client per episode, its
  own session) through the sampler's `OpenAIServer` and `AgentRunner`: HTTP, JSON, the chat
  template on every request, the micro-batcher, the recording and the assembly.

Both produce the same tokens per episode (no stop token: every turn has TOKENS tokens). Printed:
median wall seconds and generated tokens/s over ``--reps`` alternating rounds, after a warm-up.

    python benchmarks/agent_endpoint.py                       # 32 episodes x 2 turns x 24 tokens
    python benchmarks/agent_endpoint.py --tokens 1            # the per-request overhead alone
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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from agent_support import write_chat_tiny  # noqa: E402 (the tests' tiny chat checkpoint)
from asyncrl.rl.agents.runner import AgentRunner  # noqa: E402
from asyncrl.rl.agents.server import OpenAIServer  # noqa: E402
from asyncrl.rl.agents.session import SessionCall, assemble  # noqa: E402
from asyncrl.rl.generation import SamplingParams  # noqa: E402
from asyncrl.rl.model.policy import load_policy  # noqa: E402
from asyncrl.rl.sampler.hf import HFBackend  # noqa: E402
from asyncrl.rl.tasks.agent import FunctionAgent  # noqa: E402
from asyncrl.rl.tasks.scoring import UserCalls  # noqa: E402


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what comes next?"}]


async def direct(backend, tok, params, episodes: int) -> int:
    def ids(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    conversations = [question(i) for i in range(episodes)]
    calls: list[list[SessionCall]] = [[] for _ in range(episodes)]
    for _ in range(2):
        prompts = [ids(m) for m in conversations]
        groups = await backend.generate(prompts, 1, params)
        for i, (prompt, [c]) in enumerate(zip(prompts, groups)):
            calls[i].append(SessionCall(prompt, c.token_ids, c.logprobs, 0, c.finish_reason))
            conversations[i] = conversations[i] + [
                {"role": "assistant", "content": c.text},
                {"role": "user", "content": "And then?"},
            ]
    samples = [s for c in calls for s in assemble(c)]
    return sum(sum(s.action_mask) for s in samples)


async def endpoint(server, episodes: int, tokens: int) -> int:
    async def agent(i, client):
        messages = question(i)
        for _ in range(2):
            answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=tokens)
            messages = messages + [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": "And then?"},
            ]
        return 0.0

    calls = UserCalls("bench", 600.0, 1.0, workers=max(16, episodes))
    try:
        done = await AgentRunner(FunctionAgent.of(agent)(), server, calls).episodes(list(range(episodes)), 1)
    finally:
        calls.close()
    assert all(not o.error for _, o in done), [o.detail for _, o in done if o.error][:1]
    return sum(sum(s.action_mask) for samples, _ in done for s in samples)


async def main(args) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, fmt = load_policy(write_chat_tiny(tmp))
    backend = HFBackend(model, tokenizer=tok)
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, stop_token_ids=[])  # every turn full length

    async def generate(prompts, n, p, progress=None):
        return 0, await backend.generate(prompts, n, p, progress)

    server = OpenAIServer(generate, tok, params, max_context=512)
    await server.start()
    times = {"direct": [], "endpoint": []}
    tokens = {}
    try:
        for rep in range(args.reps + 1):  # the first round warms up
            for name in ("direct", "endpoint"):
                start = time.perf_counter()
                count = (
                    await direct(backend, tok, params, args.episodes)
                    if name == "direct"
                    else await endpoint(server, args.episodes, args.tokens)
                )
                if rep:
                    times[name].append(time.perf_counter() - start)
                tokens[name] = count
    finally:
        await server.close()
        backend.close()
    out = {
        "episodes": args.episodes,
        "turns": 2,
        "tokens_per_turn": args.tokens,
        "threads": args.threads,
        "reps": args.reps,
    }
    for name in times:
        median = statistics.median(times[name])
        out[name] = {
            "median_s": round(median, 3),
            "min_s": round(min(times[name]), 3),
            "tokens": tokens[name],
            "tokens_per_s": round(tokens[name] / median, 1),
        }
    out["endpoint_over_direct"] = round(out["endpoint"]["median_s"] / out["direct"]["median_s"], 3)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=1))
