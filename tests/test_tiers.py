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


def test_a_worker_waiting_for_a_shared_fixture_names_the_worker_that_holds_it(tmp_path):
    """`model_path`'s lock between xdist workers: a wait has its own deadline, and its error names
    the holder (written into the lock file) and what it builds, not a bare pytest-timeout."""
    import pytest

    from conftest import _hold

    with open(tmp_path / ".lock", "a+") as first:
        _hold(first, 1.0, "a model")
        with open(tmp_path / ".lock", "a+") as second, pytest.raises(pytest.fail.Exception) as failed:
            _hold(second, 0.3, "the shared model")
    assert "waited 0.3 s for xdist worker" in str(failed.value)
    assert f"(pid {os.getpid()}) to finish building the shared model" in str(failed.value)
    with open(tmp_path / ".lock", "a+") as third:  # the holder closed it: free again
        _hold(third, 0.3, "a model")


def test_the_longest_first_order_names_tiered_files_once():
    """`LONGEST_FIRST` (the order pytest-xdist hands out the slowest files in) names files that exist."""
    from conftest import LONGEST_FIRST

    tiered = {name for names in TIERS.values() for name in names}
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), "named twice"
    assert not set(LONGEST_FIRST) - tiered, f"not test files: {sorted(set(LONGEST_FIRST) - tiered)}"
