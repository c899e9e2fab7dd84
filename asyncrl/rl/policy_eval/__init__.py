"""``asyncrl eval POLICY``: the held-out solve rates and task metrics of a saved policy, greedy and
sampled, as a run's own evaluation measures them.

POLICY is a Hugging Face checkpoint directory (``RUN_DIR/final``, ``RUN_DIR/best``), or a
checkpoint (``RUN_DIR/checkpoints/step-N``, whose policy is its ``model/``). Inside a run
directory the run's config.json gives the task and the evaluation's settings (its held-out split,
``eval_samples``, the sampling temperature); ``--config FILE`` and ``--section.key VALUE`` apply
on top, as on a run's command line (`grpo_main`'s parser, task type included). The policy is
prompted in its own format (`load_policy`: the prompt style the run saved beside it).

The evaluation is the run's: `asyncrl.rl.model.evaluation.evaluate` on the task's held-out split
(``Task.splits``), greedy then ``eval_samples`` completions a problem at the temperature, the
task's calls under the run's deadline and failure budget, merged as the trainer merges them
(`asyncrl.rl.trainer.heldout.HeldoutEvaluation`). On the CPU (or ``--engine hf``) the completions
come from transformers' ``generate`` in the trainer's batches, so a greedy solve rate and the
greedy episodes' task metrics are the numbers the run's own evaluation of that policy logged;
the sampled rate is a draw from ``--seed``. With ``--engine vllm`` (the default where a GPU and
vLLM are there) they come from a vLLM engine built by the samplers' factory (`make_backend`).

Every mistake (a path without a policy, a key, a value) is a one-line `ConfigError` (exit status 2)
before anything loads; the task's code failing past its budget is exit status 1.
"""

from asyncrl.rl.policy_eval.command import main

__all__ = ["main"]
