"""Models that score: the scorer actor (``actor.py``) serves a teacher's per-token log-probs of
completions the samplers made (on-policy distillation), a reward model's scalar (``reward.py``) or
a generative judge's verdict (``judge.py``)."""
