"""A model that scores: the scorer actor (``actor.py``) serves a teacher's per-token log-probs of
completions the samplers made (prefill only, no generation), for on-policy distillation."""
