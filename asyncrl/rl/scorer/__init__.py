"""Models that score: the scorer actor (``actor.py``) serves, through the one `Scorer`
(``base.py``) its kind makes (``factory.py``), a teacher's per-token log-probs of completions the
samplers made (on-policy distillation, ``teacher.py``), a reward model's scalar (``reward.py``) or
a generative judge's verdict (``judge.py``)."""
