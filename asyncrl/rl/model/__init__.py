"""Policies: loading one and its prompt format (``policy.py``), solve rates (``evaluation.py``), and
the embedded default model (``tokenizer.py``, ``warm_start.py``; its training rows from the task's
demonstrations: ``demonstrations.py``)."""
