"""The GRPO example across two nodes: node 0 (the driver) in this network namespace, node 1 (an
agent, ``asyncrl launch --node-rank 1``) in a namespace of its own with an address of its own, as a
second host has; CURVE with a cluster secret, gloo, ``--run.placement`` (docs/multinode.md).

* 2 trainer ranks on node 0, a sampler on node 1: the run reaches its last step and the held-out
  evaluation after it.
* The same with a second sampler on node 0, and node 1's agent SIGKILLed mid-run: the run says
  that node 1 was lost, goes on with the sampler left and reaches its last step.
* The reverse (2 trainer ranks on node 1, the sampler on node 0), node 1's agent SIGKILLed after
  the first checkpoint: the run stops within its deadline naming the lost node and how to resume;
  resumed across the two nodes again, it reaches its last step and the held-out evaluation.
* An elastic run (``--nnodes 1:2``) started on node 0 alone: node 1 joins mid-run, a scale-up
  puts a sampler there, which takes the current weights before any of its groups is trained;
  node 1's agent told to stop drains it first (docs/elastic.md).

Every process of node 1 is gone after its agent's death, and nothing is left in its namespace.
Two fast tests check the option itself: its forms, and a node the run lacks refused up front.
The runs use tests/conftest.py's `model_path` (a 64-wide one-layer Qwen2, warm-started once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from asyncrl import Supervisor
from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import ConfigError, parse_overrides
from asyncrl.rl.config.run import Placement
from asyncrl.rl.driver.devices import plan_devices
from asyncrl.rl.driver.run import train
from asyncrl.rl.driver.start_checks import check_placement
from asyncrl.runtime.status import StatusUnavailableError, query_status
from conftest import descendants, kill_all, process_alive, wait_until
from multinode_support import (
    NODE_TIMEOUT_S,
    agent_log,
    env,
    free_port,
    launch_argv,
    make_secret_file,
    netns_pids,
    start_agent,
    veth_namespaces,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "grpo_countdown.py")
pytestmark = pytest.mark.timeout(300)
RUN_S = 120.0
"""A whole run's limit (each takes about 15 s alone on this 2-core machine)."""
STOP_S = 2 * NODE_TIMEOUT_S + 30.0
"""How soon after node 1's loss a run that cannot go on must have stopped: the loss is known within
the node timeout, then the trainer ranks' calls fail at once and the actors are stopped."""


def small(run_dir, *overrides: str) -> list[str]:
    return [
        "--run.run_dir",
        str(run_dir),
        "--trainer.world_size",
        "2",
        "--run.groups_per_step",
        "2",
        "--sampler.group_size",
        "4",
        "--sampler.prompts_per_batch",
        "2",
        "--sampler.max_new_tokens",
        "24",
        "--run.n_train",
        "400",
        "--run.n_heldout",
        "8",
        "--run.eval_every",
        "1000",
        "--run.eval_samples",
        "0",
        "--run.checkpoint_every",
        "0",
        "--sampler.backend",
        "hf",
        "--run.generate_timeout_s",
        "30",
        "--run.queue_timeout_s",
        "90",
        "--run.sync_timeout_s",
        "20",
        "--run.rendezvous_timeout_s",
        "30",
        "--run.restart_timeout_s",
        "20",
        "--run.curves",
        "false",  # no curves.png: matplotlib's seconds at every run's end; test_observe.py draws it
        *overrides,
    ]


class TwoNodes:
    """One run of the example over node 0 (here) and node 1 (an agent in ``namespace``)."""

    def __init__(
        self,
        tmp_path,
        namespace: str,
        master: str,
        args: list[str],
        name: str,
        env0: dict[str, str] | None = None,
        env1: dict[str, str] | None = None,
    ):
        """``env0``, ``env1``: more environment for node 0 (the driver) and node 1 (the agent)."""
        self.log_dir = tmp_path / name
        self.log_dir.mkdir()
        self.run_dir = args[args.index("--run.run_dir") + 1] if "--run.run_dir" in args else ""
        self.namespace = namespace
        secret = make_secret_file(str(self.log_dir))
        port = free_port(master)
        self.agent = start_agent(
            1, 2, port, secret, str(self.log_dir), master=master, netns=namespace, OMP_NUM_THREADS="1", **(env1 or {})
        )
        self.driver_log = open(self.log_dir / "driver.log", "wb")
        self.driver = subprocess.Popen(
            launch_argv(0, 2, port, secret, master, EXAMPLE, *args),
            cwd=tmp_path,
            env=env(ASYNCRL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", **(env0 or {})),
            stdin=subprocess.DEVNULL,
            stdout=self.driver_log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return (self.log_dir / "driver.log").read_text(errors="replace")

    def node1_actors(self) -> dict[int, str]:
        """The actor processes node 1's agent runs (forked by its zygote, so their /proc environ
        is the zygote's): pid -> actor name, as the run's status names its actors on node 1."""
        try:
            actors = query_status(self.run_dir, 10.0).actors
        except StatusUnavailableError:  # not serving yet
            return {}
        below = descendants(self.agent.pid)
        return {a.pid: a.name for a in actors if a.node == 1 and a.pid in below}

    def kill_node1(self) -> list[int]:
        """SIGKILL node 1's agent (its actors die with it); returns their pids, for the check."""
        pids = list(self.node1_actors())
        self.agent.send_signal(signal.SIGKILL)
        self.agent.wait(10)
        return pids

    def finish(self, timeout_s: float = RUN_S) -> int:
        try:
            return self.driver.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end within {timeout_s:g} s:\n{self.output()[-3000:]}")

    def close(self) -> None:
        kill_all([self.driver.pid, self.agent.pid])
        self.driver.wait()
        self.agent.wait()
        self.driver_log.close()


@pytest.fixture
def node1():
    """One network namespace for node 1: ``(namespace, node 0's address, node 1's address)``."""
    with veth_namespaces(1) as (made,):
        yield made


def wait_for(predicate, what: str, run: TwoNodes, timeout_s: float = RUN_S) -> None:
    if not wait_until(predicate, timeout_s, 0.05):
        pytest.fail(f"{what} not within {timeout_s:g} s (driver exit {run.driver.poll()}):\n{run.output()[-3000:]}")


def step_done(run_dir) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_node1_clean(run: TwoNodes, pids: list[int]) -> None:
    assert wait_until(lambda: not any(process_alive(p) for p in pids), 10.0), [p for p in pids if process_alive(p)]
    assert wait_until(lambda: not netns_pids(run.namespace), 10.0), netns_pids(run.namespace)


def test_placement_names_a_node_per_actor_and_refuses_what_the_cluster_cannot_hold():
    assert Placement.parse("node0").nodes("sampler", 2, 3) == [None, None]  # today's: the supervisor decides
    assert Placement.parse("spread").nodes("trainer", 2, 3) == [0, 0]
    assert Placement.parse("spread").nodes("sampler", 3, 3) == [1, 2, 1]
    assert Placement.parse("spread").nodes("sampler", 2, 1) == [0, 0]  # one node: nowhere else to go
    explicit = Placement.parse("trainer=1  sampler=0,1")
    assert explicit.nodes("trainer", 2, 2) == [1, 1] and explicit.nodes("sampler", 3, 2) == [0, 1, 0]
    assert Placement.parse("sampler=1").nodes("trainer", 2, 2) == [None, None]
    for bad in ("nodes", "trainer=", "trainer=a", "trainer=0 trainer=1", "learner=0", "trainer:0", ""):
        with pytest.raises(ConfigError, match="^--run.placement .*placement must be 'node0', 'spread' or node ranks"):
            parse_overrides(GRPOConfig(), ["--run.placement", bad])
    with pytest.raises(
        ConfigError,
        match=r"puts a sampler on node 2, but the run has 2 node\(s\) \(0..1\); launch "
        "with --nnodes 3 or more",
    ):
        check_placement("sampler=0,2", 1, 2, 2, plan_devices("cpu", None, [], 2))
    colocated = plan_devices("auto", "cuda", ["0"], 1)
    assert check_placement("trainer=1 sampler=1", 1, 1, 2, colocated) == ([1], [1])
    with pytest.raises(ConfigError, match="puts samplers on another node than trainer rank 0, but they share its GPU"):
        check_placement("spread", 1, 1, 2, colocated)


async def test_a_placement_on_a_node_the_run_lacks_is_refused_before_anything_is_written(tmp_path):
    config = parse_overrides(GRPOConfig(), ["--run.run_dir", str(tmp_path / "run"), "--run.placement", "trainer=1"])
    async with Supervisor() as sup:
        with pytest.raises(ConfigError, match="puts a trainer on node 1, but the run has 1 node"):
            await train(config, sup, log=lambda *a: None)
        assert not sup.status()  # nothing spawned
    assert not (tmp_path / "run").exists()


def test_two_trainer_ranks_on_node0_and_a_sampler_on_node1_run_the_example(model_path, node1, tmp_path):
    namespace, master, addr1 = node1
    run_dir = tmp_path / "run"
    run = TwoNodes(
        tmp_path,
        namespace,
        master,
        [
            "--model_path",
            model_path,
            "--run.placement",
            "spread",
            "--run.steps",
            "3",
            "--run.check_weights",
            "true",
            *small(run_dir),
        ],
        "spread",
    )
    try:
        wait_for(
            lambda: "sampler0" in run.node1_actors().values() or run.driver.poll() is not None,
            "sampler0 running on node 1",
            run,
        )
        assert sorted(run.node1_actors().values()) == ["sampler0"], run.output()[-3000:]
        assert run.finish() == 0, run.output()[-3000:] + agent_log(str(run.log_dir), 1)[-2000:]
        assert run.agent.wait(15) == 0, agent_log(str(run.log_dir), 1)
    finally:
        run.close()
    out = run.output()
    assert (
        f"placement: trainer rank(s) on node(s) 0,0, sampler0 on node 1; the weight-sync group meets at {master}" in out
    ), out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["heldout_problems"] == 8 and "greedy" in summary["heldout_after"]
    # every group trained on came from the sampler on node 1, which generates only after a sync;
    # after each sync it held the trainer's exact weights (--run.check_weights)
    rs = records(run_dir)
    assert {gid.split("/")[0] for r in rs for gid in r["group_ids"]} == {"sampler0"}
    assert all(r["weights_digests"]["sampler0"] == r["weights_digests"]["trainer"] for r in rs)
    assert wait_until(lambda: not netns_pids(namespace), 10.0), netns_pids(namespace)


def test_losing_the_samplers_node_leaves_the_run_to_the_sampler_on_node0(model_path, node1, tmp_path):
    namespace, master, _ = node1
    run_dir = tmp_path / "run"
    steps = 12
    run = TwoNodes(
        tmp_path,
        namespace,
        master,
        [
            "--model_path",
            model_path,
            "--run.placement",
            "trainer=0 sampler=1,0",
            "--sampler.count",
            "2",
            "--run.steps",
            str(steps),
            "--run.check_weights",
            "true",
            *small(run_dir),
        ],
        "lose-sampler",
    )
    try:
        wait_for(lambda: step_done(run_dir) >= 2 or run.driver.poll() is not None, "step 2", run)
        assert run.driver.poll() is None, run.output()[-3000:]
        assert sorted(run.node1_actors().values()) == ["sampler0"]
        pids = run.kill_node1()
        assert run.finish() == 0, run.output()[-3000:]
        assert_node1_clean(run, pids)
    finally:
        run.close()
    out = run.output()
    assert "node 1" in out and "lost" in out, out[-3000:]
    faults = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    lost = [f for f in faults if f["event"] == "lost" and f["sampler"] == "sampler0"]
    assert lost and "node 1" in lost[0]["detail"], faults
    rs = records(run_dir)
    assert [r["step"] for r in rs] == list(range(1, steps + 1))
    assert sum(r["sampler_losses"] for r in rs) >= 1 and rs[-1]["samplers_in_group"] == 1
    # before the loss, the sampler on node 1 was in the group and took the weights of every sync, exactly
    assert all(r["weights_digests"].get("sampler0") == r["weights_digests"]["trainer"] for r in rs[:2])
    assert all("sampler0" not in r["weights_digests"] for r in rs[-2:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and "greedy" in summary["heldout_after"]


def test_losing_the_trainers_node_stops_the_run_resumably_and_it_resumes_across_nodes(model_path, node1, tmp_path):
    namespace, master, addr1 = node1
    run_dir = tmp_path / "run"
    args = [
        "--model_path",
        model_path,
        "--run.placement",
        "trainer=1 sampler=0",
        "--run.steps",
        "6",
        *small(run_dir, "--run.checkpoint_every", "2"),
    ]
    run = TwoNodes(tmp_path, namespace, master, args, "lose-trainer")
    try:
        first = run_dir / "checkpoints" / "step-00000002"
        wait_for(lambda: first.exists() or run.driver.poll() is not None, "the first checkpoint", run)
        assert run.driver.poll() is None, run.output()[-3000:]
        assert sorted(run.node1_actors().values()) == ["trainer", "trainer-1"]
        pids = run.kill_node1()
        lost_at = time.monotonic()
        code = run.finish(STOP_S)
        stopped_s = time.monotonic() - lost_at
        assert_node1_clean(run, pids)
    finally:
        run.close()
    out = run.output()
    print(f"the run stopped {stopped_s:.1f} s after node 1's agent was killed")  # shown with -rP
    assert code == 1 and stopped_s < STOP_S, out[-3000:]
    assert (
        f"placement: trainer rank(s) on node(s) 1,1, sampler0 on node 0; the weight-sync group meets at {addr1}" in out
    ), out[-3000:]
    assert "trainer rank 0: node 1 (" in out and ") lost: " in out, out[-3000:]
    assert "--resume run (checkpoint step 2)" in out, out[-3000:]  # the hint names it relative to the cwd

    resumed = TwoNodes(tmp_path, namespace, master, ["--resume", str(run_dir)], "resume")
    try:
        assert resumed.finish() == 0, resumed.output()[-3000:]
        assert resumed.agent.wait(15) == 0
    finally:
        resumed.close()
    assert "resuming from" in resumed.output()
    assert [r["step"] for r in records(run_dir)] == list(range(1, 7))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"] and "greedy" in summary["heldout_after"]
    assert wait_until(lambda: not netns_pids(namespace), 10.0), netns_pids(namespace)


def test_a_node_joining_an_elastic_run_takes_a_sampler_that_syncs_first_and_drains_it_when_leaving(
    model_path, node1, tmp_path
):
    # --nnodes 1:2: the run starts on node 0 alone; node 1 joins mid-run, `asyncrl scale` puts the
    # new sampler there (the node with the fewest), it takes the current weights before it
    # generates; then node 1's agent is told to stop: the sampler is drained (nothing it
    # delivered lost, not counted a loss), the agent leaves once it is stopped, the run goes on.
    from asyncrl.rl.driver.scaling import scale

    namespace, master, _ = node1
    run_dir, log_dir = tmp_path / "run", tmp_path / "logs"
    log_dir.mkdir()
    secret, port = make_secret_file(str(log_dir)), free_port(master)
    args = [
        "--model_path",
        model_path,
        "--sampler.count",
        "1",
        "--run.steps",
        "100000",
        "--run.check_weights",
        "true",
        *small(run_dir, "--trainer.world_size", "1"),
    ]
    with open(log_dir / "driver.log", "wb") as out:
        driver = subprocess.Popen(
            launch_argv(0, "1:2", port, secret, master, EXAMPLE, *args),
            cwd=tmp_path,
            env=env(ASYNCRL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1"),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    agent = None

    def output() -> str:
        return (log_dir / "driver.log").read_text(errors="replace")[-3000:]

    def progress() -> dict:
        return query_status(str(run_dir), 30.0).progress

    def until(predicate, what: str) -> None:
        if not wait_until(lambda: predicate() or driver.poll() is not None, RUN_S, 0.2) or driver.poll() is not None:
            pytest.fail(f"{what} not within {RUN_S:g} s (driver exit {driver.poll()}):\n{output()}")

    def steps_from_sampler1() -> list[int]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]  # the last may be half written
        records = [json.loads(line) for line in lines]
        return [r["step"] for r in records if any(g.startswith("sampler1/") for g in r["group_ids"])]

    started = time.monotonic()
    try:
        until(lambda: step_done(run_dir) >= 2, "step 2 on node 0 alone")
        agent = start_agent(
            1,
            "1:2",
            port,
            secret,
            str(log_dir),
            master=master,
            netns=namespace,
            OMP_NUM_THREADS="1",
            ASYNCRL_SUP_DRAIN_TIMEOUT_S="120",
        )
        until(lambda: [n.state for n in query_status(str(run_dir), 30.0).nodes] == ["joined", "joined"], "node 1 joins")
        scaled_at = step_done(run_dir)
        assert scale(str(run_dir), 2, 30.0)["target"] == 2
        until(lambda: progress().get("samplers", {}).get("sampler1") == "in group", "sampler1 in the group")
        assert {a.name: a.node for a in query_status(str(run_dir), 30.0).actors}["sampler1"] == 1
        until(steps_from_sampler1, "a batch with a group of sampler1")  # on a loaded CPU, not at once
        # Steps go on while the status is polled: sampler1's first group may already be trained by
        # the time "in group" is seen, but never in a step that ended before the scale-up.
        assert steps_from_sampler1()[0] > scaled_at
        agent.send_signal(signal.SIGTERM)
        until(lambda: progress()["samplers"]["sampler1"] == "drained", "sampler1 drained")
        assert agent.wait(60) == 128 + signal.SIGTERM, agent_log(str(log_dir), 1)
        drained_at = step_done(run_dir)
        until(lambda: step_done(run_dir) >= drained_at + 2, "2 steps after node 1 left")
        driver.send_signal(signal.SIGTERM)
        driver.wait(60)
    finally:
        kill_all([driver.pid, *([agent.pid] if agent else [])])
        driver.wait()
        if agent:
            agent.wait()
    print(f"node 1 joined, took a sampler and left in {time.monotonic() - started:.0f} s")  # shown with -rP
    assert wait_until(lambda: not netns_pids(namespace), 10.0), netns_pids(namespace)
    rs = records(run_dir)
    with_1 = [r for r in rs if "sampler1" in r["weights_digests"]]
    assert with_1 and all(r["weights_digests"]["sampler1"] == r["weights_digests"]["trainer"] for r in with_1)
    first = with_1[0]["step"]  # the sync that took it in: no group of it was trained before
    assert not any(g.startswith("sampler1/") for r in rs if r["step"] <= first for g in r["group_ids"]), rs
    assert any(g.startswith("sampler1/") for r in rs for g in r["group_ids"]), "sampler1 never delivered"
    assert sum(r["sampler_losses"] for r in rs) == 0  # drained, not lost
    # The drain's sync re-formed the group without sampler1; the target of 2 starts a replacement on
    # node 0 at that sync, which joins at a later one: how soon depends on its start (0.6 s forked by
    # the zygote, ~10 s by Popen), so the last steps may have one sampler in the group or two.
    last_with_1 = with_1[-1]["step"]
    assert any(r["samplers_in_group"] == 1 for r in rs if r["step"] > last_with_1), rs[-5:]
    assert set(rs[-1]["weights_digests"]) <= {"trainer", "sampler0", "sampler2"}, rs[-1]
    events = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    (leaving,) = [e for e in events if e["event"] == "node_leaving"]
    assert leaving["node"] == 1 and leaving["samplers"] == 1, events
    assert [e["sampler"] for e in events if e["event"] == "drained"] == ["sampler1"], events
    assert not [e for e in events if e["event"] == "lost"], events
    assert "leaving once the 1 actor(s) here are stopped" in agent_log(str(log_dir), 1)
