"""Writes examples/data/guess_numbers.jsonl: the secrets of the guessing agent (examples/agent_guess.py)."""

import json
import os
import random

rng = random.Random("guess/0")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "guess_numbers.jsonl"), "w") as f:
    for _ in range(1000):
        f.write(json.dumps({"secret": rng.randint(1, 100), "low": 1, "high": 100}) + "\n")
