"""The sampler role: `SamplerActor` (``actor.py``) over a `SamplerBackend` (``backend.py``: the
interface, its request/result types and `WeightSink`) that ``factory.py`` picks and builds:
``hf.py`` (transformers, weights received in the actor through ``sink.py``) or ``vllm/`` (vLLM's
engine, weights received in its worker process). Import from the modules; this one imports none.
"""
