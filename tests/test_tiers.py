"""Every test file has one tier (tests/conftest.py's TIERS), so the fast tier cannot silently miss
or gain a file: a new file fails here until it is given a line."""

from __future__ import annotations

import os

from conftest import TIERS

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_test_file_has_exactly_one_tier():
    files = {name for name in os.listdir(HERE) if name.startswith("test_") and name.endswith(".py")}
    tiered = [f"test_{name}.py" for names in TIERS.values() for name in names]
    twice = sorted({name for name in tiered if tiered.count(name) > 1})
    assert not twice, f"in two tiers: {twice}"
    assert not files - set(tiered), f"no tier in tests/conftest.py TIERS: {sorted(files - set(tiered))}"
    assert not set(tiered) - files, f"TIERS names files that do not exist: {sorted(set(tiered) - files)}"
