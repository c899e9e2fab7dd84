"""Agents written against the OpenAI API, trained as they are (docs/agents.md).

``server.py``: the OpenAI-compatible endpoint a sampler serves (aiohttp, on the actor's loop);
``wire.py``: the request bodies and answers; ``refusal.py``: the error answers (OpenAI's body);
``sse.py``: a ``stream: true`` answer as server-sent events; ``stream.py``: a stream's text as
tokens come; ``batcher.py``: requests into ``generate`` calls;
``chat.py``: requests through the policy's chat template, tool calls out of its text;
``session.py``: per-episode recording of the exact token ids, log-probs and weight versions, and
the samples assembled from them; ``runner.py``: an `Agent`'s episodes, one session each, into
rollout groups. The user's side (`Agent`, an async function) is ``rl/tasks/agent.py``.
"""
