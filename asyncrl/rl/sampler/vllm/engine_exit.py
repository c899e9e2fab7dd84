"""vLLM's engine processes exit without the interpreter's last garbage collections.

Once vLLM has torn an engine down explicitly (its worker processes told to stop and their queues,
model runner and process groups released; then the engine-core's scheduler and process groups),
each of its processes exits as any Python process does, and the interpreter's finalisation then
runs full cyclic garbage collections over the whole heap: vLLM, torch and transformers, several
hundred thousand objects. On a loaded 2-core CPU machine that took longer than vLLM's 5 s grace
for each process (benchmarks/README.md, "Figures that were in the code"), so every ``VLLMBackend.close``
waited out the grace and then had vLLM SIGKILL both.

`plugin` makes those collections find nothing to scan: an ``atexit`` handler (atexit runs before
finalisation) freezes the heap (``gc.freeze``). Nothing is lost that must be released: vLLM's own
teardown has run before, reference-counted objects are still destroyed as their modules are
cleared, and what a cycle held (file descriptors, mappings) the process exit releases; what vLLM
leaves outside a process, as after a kill, is the janitor's (``janitor.py``). vLLM does the same on
ROCm for its engine core (``run_engine_core``).

It is a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point): vLLM calls it in
each of its processes, the engine core's and the workers' included, in every program that uses
vLLM where asyncrl is installed. It acts only in the processes of an engine `VLLMBackend` started
(`STARTER` names the process that started it, set before the start and inherited by the engine's
processes), and not in that process itself.
"""

from __future__ import annotations

import atexit
import gc
import os

STARTER = "ASYNCRL_VLLM_STARTER_PID"
"""The pid of the process that started the engine (`VLLMBackend`); its children inherit it."""

_registered = False


def plugin() -> None:
    """vLLM's general plugin hook: in an engine's own processes, freeze the heap at exit.
    Idempotent (vLLM may load plugins more than once in a process)."""
    global _registered
    starter = os.environ.get(STARTER)
    if _registered or not starter or starter == str(os.getpid()):
        return
    _registered = True
    atexit.register(gc.freeze)
