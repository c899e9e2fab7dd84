"""Shared helpers: real processes, found and checked through /proc (no mocks); and the tier of
every test file (`TIERS`), given to its tests as a marker."""

from __future__ import annotations

import os
import signal
import time

import pytest

# The support modules whose fixtures and helpers assert, rewritten like a test file so that a failed
# assert shows its values. Registered here, before any test file is imported: registered from a
# test file, a module another file (or its helper) imported first stays unrewritten, and pytest
# warns "Module already imported so cannot be rewritten".
pytest.register_assert_rewrite("sampler_support", "vllm_support", "hccl_support")

TIERS = {
    # in one process, no model to train, seconds in all: `python -m pytest -m unit`, the fast tier
    # (no transformers import: the two in-process files that need it, episodes and flops, are rl's)
    "unit": (
        "actor_spec",
        "arith",
        "code_text",
        "codec",
        "config",
        "config_files",
        "corrections",
        "countdown",
        "decoding_watch",
        "ctypes_table",
        "device_plan",
        "heldout_parts",
        "layering",
        "layout",
        "loop_watch",
        "long_tails",
        "loss",
        "pacing",
        "pyhccl_communicator",
        "pyhccl_library",
        "rollout_queue",
        "run_progress",
        "sampler_parts",
        "throttled_log",
        "tiers",
    ),
    # the actor runtime with real processes and sockets: supervisors, calls, kills, nodes, status
    "runtime": (
        "agent_spawn",
        "auth",
        "fuzz_sockets",
        "kill",
        "lifecycle",
        "multinode",
        "process_cpu",
        "remote_errors",
        "rpc",
        "rpc_tensors",
        "start_phases",
        "status",
        "supervisor",
        "titles",
        "typed_handles",
        "zygote",
    ),
    # the weight-sync data plane: rendezvous, communicators, the sync itself
    "comm": (
        "comm_join",
        "delta_sync",
        "pynccl",
        "pyhccl_tables",
        "rendezvous",
        "staged_sync",
        "tiered",
        "weight_sync",
    ),
    # the RL components on real models and actors: sampler, trainer, tasks, the driver's pool
    "rl": (
        "agents",
        "distill",
        "episodes",
        "flops",
        "heldout_samplers",
        "judge",
        "lora",
        "model",
        "packing",
        "recovery_pool",
        "reward_model",
        "sampler",
        "scaling_pool",
        "scorer",
        "scorer_factory",
        "shared_engine",
        "stall",
        "sync_phases",
        "tasks",
        "trainer",
        "trainer_compile",
        "trainer_group",
        "trainer_head",
        "user_task",
        "vllm_actor",
        "vllm_backend",
        "vllm_compat",
        "vllm_worker",
        "warm_start",
    ),
    # whole runs and scripts: GRPO runs, `asyncrl launch`, the examples, resumes, faults on a run
    "e2e": (
        "elastic",
        "examples",
        "fault_tolerance",
        "grpo",
        "grpo_multinode",
        "launch_errors",
        "lora_vllm",
        "multinode_netns",
        "multiturn_vllm",
        "observe",
        "policy_eval",
        "run_lifecycle",
        "start_loss",
        "user_errors",
    ),
    # an accelerator (CUDA, Ascend): skipped where there is none
    "gpu": ("colocated_gpu", "gpu", "gpu_comm", "gpu_faults", "gpu_multinode", "gpu_trainer_group", "pyhccl_npu"),
}
"""The tier of each ``tests/test_<name>.py``, by its name: each of its tests gets that marker unless
it carries a tier of its own (``@pytest.mark.e2e`` on one slow test of a unit file). A new file
gets a line here (`test_tiers.py` fails until it has one). CI runs every tier; see the README."""
_TIER_OF = {f"test_{name}.py": tier for tier, names in TIERS.items() for name in names}

LONGEST_FIRST = (
    "vllm_actor",
    "trainer_group",
    "grpo_multinode",
    "policy_eval",
    "fault_tolerance",
    "observe",
    "lora",
    "run_lifecycle",
    "vllm_backend",
    "shared_engine",
    "lora_vllm",
    "user_task",
    "multinode",
    "weight_sync",
    "sampler",
    "user_errors",
    "grpo",
    "rpc_tensors",
    "start_loss",
    "launch_errors",
    "supervisor",
    "agents",
    "delta_sync",
    "rpc",
    "heldout_samplers",
    "tasks",
    "distill",
    "elastic",
)
"""The test files that take longest under the README's command (the seconds of each file's tests in
one run, their JUnit times summed, 324 down to 18, on a 2-core VM, 2026-11-29), longest first. Under
pytest-xdist these are handed out first and every other file after them in collection order (longest
processing time first), so that both workers end on short files. xdist's own order for ``--dist
loadfile`` (most tests first) left the vLLM files of a few tests each for last: one worker idled 35 s
at the end while the other ran the last (test_lora_vllm.py); 2 s so. A file missing here only runs
later; `test_tiers.py` checks that each name is a tiered file."""
_RANK = {f"test_{name}.py": i for i, name in enumerate(LONGEST_FIRST)}


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        action="append",
        default=[],
        choices=sorted(TIERS),
        help="run only the tests of this tier (repeat for several); the files of the other tiers are "
        "not even imported, which `-m unit` would do (about 25 s of torch and vLLM imports)",
    )


def pytest_ignore_collect(collection_path, config):
    tiers = config.getoption("--tier")
    if tiers and collection_path.name in _TIER_OF and _TIER_OF[collection_path.name] not in tiers:
        return True
    return None


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", False):  # pytest-xdist's: hand out files in our order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `LONGEST_FIRST`; a file's tests keep their order
        items.sort(key=lambda item: _RANK.get(os.path.basename(str(item.fspath)), len(_RANK)))
    for item in items:
        tier = _TIER_OF.get(os.path.basename(str(item.fspath)))
        if tier is not None and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(tier)
    tiers = config.getoption("--tier")
    if tiers:  # a test whose own marker puts it in another tier than its file's
        chosen = [item for item in items if any(item.get_closest_marker(t) for t in tiers)]
        config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
        items[:] = chosen


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def orphaned_shm(before: set[str]) -> set[str]:
    """The /dev/shm entries new since ``before`` that no living process maps: what a process that
    ended left behind. Another program's segments in use on the same host (a second run, a
    parallel test) are mapped, so they do not count. By inode: a semaphore is mapped under a
    deleted temporary name, never its own (see the vLLM janitor)."""
    in_use: set[int] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/maps") as f:
                    in_use.update(int(line.split()[4]) for line in f if "/dev/shm/" in line)
            except (OSError, IndexError, ValueError):
                continue
    left = set()
    for name in shm_names() - before:
        try:
            if os.stat(os.path.join("/dev/shm", name)).st_ino not in in_use:
                left.add(name)
        except OSError:  # removed meanwhile
            continue
    return left


def command_line(pid: int) -> str:
    """What ``ps -o args`` shows of ``pid``: its command line (or title), arguments joined by spaces."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return " ".join(arg.decode() for arg in f.read().split(b"\0") if arg)


def descendants(pid: int) -> set[int]:
    """Every living process below ``pid`` (children, grandchildren, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(entry)] = int(fields[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passes (tests only: observing other processes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_at_test_start: set[int] = set()


def new_descendants() -> set[int]:
    """The living processes below this one that the running test started (not, say, the
    multiprocessing resource tracker an in-process vLLM engine of an earlier module left running
    for the rest of the session, as it is meant to)."""
    return descendants(os.getpid()) - _at_test_start


@pytest.fixture(autouse=True)
def no_leftover_processes(zygote_pool):
    """Every test must leave no process of ours behind (but the zygotes the session's pool keeps)."""
    global _at_test_start
    before = _at_test_start = descendants(os.getpid())
    yield
    left = descendants(os.getpid()) - before - zygote_pool.pids
    if left:  # a process that is ending may take a moment (each look reads all of /proc: not when none is left)
        wait_until(lambda: not descendants(os.getpid()) - before - zygote_pool.pids, 5.0)
        left = descendants(os.getpid()) - before - zygote_pool.pids
    kill_all(left)
    assert not left, f"processes left behind: {sorted(left)}"


def _workers_dir(tmp_path_factory, name: str):
    """A directory for this test session: under pytest-xdist one that its workers share (in the
    controller's base directory, the parent of each worker's own), else one of this process's."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp(name)
    path = tmp_path_factory.getbasetemp().parent / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """One ``ASYNCRL_CACHE_DIR`` for the runs a test session launches: a run warm-starts its embedded
    model once per cache key (its model, warm start and task), so the runs of one tiny config
    (test_grpo's ``TINY``, in five files) build it once, not once a test. The cache is safe to
    share: a key is built in a directory of its own and renamed into place whole. Under pytest-xdist
    its workers share it too (a key both build at once is built twice, used whole either way)."""
    return str(_workers_dir(tmp_path_factory, "model-cache"))


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> str:
    """A 64-wide one-layer Qwen2 warm-started for 400 steps (about 10 s, once per test session): it
    writes well-formed answers often enough that rewards differ within groups, so gradients and the
    optimiser state are not zero. For the GRPO runs of test_fault_tolerance and test_run_lifecycle.
    Under pytest-xdist its workers share it: the first to need it builds it (the others wait on
    the lock) into a cache they all read (`default_model`'s, a key renamed into place whole)."""
    cache = _workers_dir(tmp_path_factory, "model-path-cache")
    with open(cache / ".lock", "a+") as lock:  # "a+": opening it must not erase the holder's name
        _hold(lock, MODEL_PATH_WAIT_S, "the warm-started test model (tests/conftest.py, model_path)")
        return _warm_started(str(cache))


MODEL_PATH_WAIT_S = 100.0
"""How long one xdist worker waits for the other to build `model_path` (about 18 s on two busy
cores), inside pytest-timeout's 120 s so that the error names who held the lock."""


def _hold(lock, wait_s: float, what: str) -> None:
    """Take an exclusive ``flock`` on the open file ``lock`` (released when it closes) within
    ``wait_s``, then write this worker's name into it; a wait that runs out fails the test naming
    the holder the file names and what it was building."""
    import fcntl

    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > end:
                lock.seek(0)
                holder = lock.read().strip() or "a process that wrote no name"
                pytest.fail(f"waited {wait_s:g} s for {holder} to finish building {what}", pytrace=False)
            time.sleep(0.2)  # a poll: flock has no timeout of its own
    lock.truncate(0)
    lock.write(f"xdist worker {os.environ.get('PYTEST_XDIST_WORKER', 'main')} (pid {os.getpid()})")
    lock.flush()


def _warm_started(cache_dir: str) -> str:
    import torch

    from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
    from asyncrl.rl.model.warm_start import default_model
    from asyncrl.rl.tasks.countdown import Countdown

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: see tests/test_sampler.py
    try:
        return default_model(
            ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128),
            WarmStartConfig(
                steps=400, batch_size=32, lr=3e-3, warmup_steps=10, n_examples=2000, eval_problems=0, heldout_reserve=20
            ),
            Countdown(),
            cache_dir=cache_dir,
            threads=1,
            log=lambda *a: None,
        )
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def zygote_pool():
    """The zygotes this test process keeps between its supervisors (runtime/zygotes/pool.py), while
    a file with `actor_zygote` runs: one zygote's imports (~11 s of CPU) per preload and session,
    not one per supervisor."""
    from asyncrl.runtime.zygotes.pool import ZygotePool

    pool = ZygotePool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def actor_zygote(zygote_pool):
    """The supervisors of a test file forking their actors from a zygote that has imported what a
    GRPO run's actors import (`asyncrl.runtime.zygotes.zygote.PRELOAD`), as `asyncrl launch` does, instead
    of starting each by ``Popen`` (4.5-8 s of CPU each for torch and transformers): for the files
    whose supervisors start trainers, samplers, scorers or actors that import torch, by
    ``pytestmark``. Two 3-actor trainer tests took 0.50x the CPU and 0.78x the wall time so (two
    runs each, paired, 2-core VM). The zygotes come from the session's `zygote_pool`, kept from one
    supervisor, and one file, to the next: one preload for every file, so one zygote serves them
    all (a lighter list of its own for a file would cost a second zygote, not save one)."""
    from asyncrl.runtime.config import ENV_PREFIX
    from asyncrl.runtime.zygotes.zygote import PRELOAD

    with pytest.MonkeyPatch.context() as patch, zygote_pool.serving():
        patch.setenv(ENV_PREFIX + "ZYGOTE_PRELOAD", ",".join(PRELOAD))
        yield


@pytest.fixture(scope="module")
def embedded_path(tmp_path_factory) -> str:
    """The embedded Qwen2 (2 layers, 64 wide, GQA) with random weights and the project's tokenizer:
    for the trainer's tests (packing, LoRA, the fused head, sync phases)."""
    import json

    import torch

    from asyncrl.rl.config.model import ModelConfig
    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.model.warm_start import new_model

    path = tmp_path_factory.mktemp("embedded")
    tok = build_tokenizer()
    torch.manual_seed(0)
    new_model(
        ModelConfig(
            hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=128
        ),
        tok,
    ).save_pretrained(path)
    tok.save_pretrained(path)
    (path / MARKER_FILE).write_text(json.dumps({"prompt_style": "compact", "max_new_tokens_hint": 20}))
    return str(path)
