"""The trainer: its actor (``actor.py``), micro-batches (``batching.py``), GRPO's loss
(``loss.py``; its policy terms: ``policy_terms.py``), and checkpoints written and loaded in its
process (``checkpoint.py``)."""
