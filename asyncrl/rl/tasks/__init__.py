"""Tasks: what a policy is asked and how its answers are scored. ``base.py`` is the protocol the
sampler, trainer and driver use (`Task`); ``countdown.py`` is the task shipped with asyncrl, and
``arith.py`` the parser its reward reads model output with."""
