"""The embedded model's warm start: the same weights whatever the thread count, threads from the
cores the process may use, and a stop that ends a build within seconds and caches nothing.
Small configurations keep the file to seconds."""

from __future__ import annotations

import os
import threading
import time

import pytest
from safetensors.torch import load_file

from asyncrl.rl.model import evaluation, warm_start
from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.model.evaluation import StoppedError
from asyncrl.rl.model.warm_start import default_model

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=64)
SHORT = WarmStartConfig(steps=12, batch_size=64, warmup_steps=2, n_examples=256, heldout_reserve=16, eval_problems=0)


def weights(path: str) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def test_warm_start_is_the_same_on_any_thread_count(tmp_path):
    """The cache key does not name the thread count, so the weights must not depend on it. Three
    threads is the case that differed (by 1 ulp, then more) before training was pinned to one:
    elementwise kernels split across 3 threads end chunks off the vector width."""
    built = {t: weights(default_model(SMALL, SHORT, cache_dir=str(tmp_path / str(t)), threads=t, log=lambda _: None))
             for t in (1, 2, 3)}
    for t in (2, 3):
        assert built[t].keys() == built[1].keys()
        assert [k for k in built[1] if not built[1][k].equal(built[t][k])] == [], f"{t} threads"


def test_threads_come_from_the_cpu_affinity_not_the_load(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0), raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert warm_start._usable_cores() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert warm_start._usable_cores() == 4  # capped: a 1M-parameter model gains little beyond


def build_in_thread(cache: str, stop: threading.Event, warm: WarmStartConfig, started: threading.Event):
    result: dict = {}

    def log(line: str) -> None:
        if "warm-starting" in line:
            started.set()

    def run() -> None:
        try:
            result["path"] = default_model(SMALL, warm, cache_dir=cache, threads=1, log=log, stop=stop)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_stop_ends_a_warm_start_within_seconds_and_caches_nothing(tmp_path):
    stop, started = threading.Event(), threading.Event()
    long = WarmStartConfig(steps=100_000, batch_size=32, warmup_steps=2, n_examples=256, heldout_reserve=16,
                           eval_problems=0)
    thread, result = build_in_thread(str(tmp_path), stop, long, started)
    assert started.wait(60), "the warm start never began training"
    time.sleep(0.5)  # a few steps in
    stop.set()
    asked = time.monotonic()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(result.get("error"), StoppedError), result
    assert result["ended"] - asked < 2.0
    assert os.listdir(tmp_path / "models") == []  # no partial entry, no leftover .tmp-* directory


def test_stop_before_training_raises_too(tmp_path):
    stop = threading.Event()
    stop.set()
    with pytest.raises(StoppedError):
        default_model(SMALL, SHORT, cache_dir=str(tmp_path), threads=1, log=lambda _: None, stop=stop)
    assert os.listdir(tmp_path / "models") == []


def test_stop_during_the_evaluation(tmp_path, monkeypatch):
    """The last long loop, the greedy evaluation, stops too (between its batches, and before saving)."""
    stop = threading.Event()
    real = evaluation._generate_rows

    def generate_then_stop(*args, **kwargs):
        stop.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "_generate_rows", generate_then_stop)
    warm = WarmStartConfig(steps=1, batch_size=8, warmup_steps=1, n_examples=64, heldout_reserve=16, eval_problems=4)
    with pytest.raises(StoppedError):
        default_model(SMALL, warm, cache_dir=str(tmp_path), threads=1, log=lambda _: None, stop=stop)
    assert os.listdir(tmp_path / "models") == []
