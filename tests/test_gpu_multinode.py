"""NCCL between two "hosts" on one machine with two GPUs: node 0 (the driver and the trainer, GPU 0)
in this network namespace, node 1 (an agent and the sampler, GPU 1) in a namespace of its own with
an address of its own, joined by a veth pair. NCCL's shared-memory and peer-to-peer transports are
off, so the weights cross over its socket transport between the two addresses, as between hosts.

* The GRPO example end to end, the sampler on node 1: the plan gives each actor a GPU (NCCL, not
  CUDA IPC: it counts both nodes' GPUs), NCCL's own log shows the channels going over NET/Socket,
  and after every sync the sampler holds the trainer's exact weights (``--run.check_weights``).
* Node 1's agent SIGKILLed mid-run: the run stops within its deadline, naming the lost node and how
  to resume; resumed with node 1 back, it reaches its last step with the weights checked.

Set ``ASYNCRL_NETNS_DRY_RUN=cpu`` to run the same scenario on the CPU with gloo (the script's own
check where no two GPUs are lent). The namespaces need root and iproute2's `ip` or, where it is
missing (the GPU machines' image), the pyroute2 library (multinode_support.netns_tool)."""

from __future__ import annotations

import os
import time

import pytest

from asyncrl.runtime.devices import detect
from conftest import wait_until
from multinode_support import agent_log, netns_pids, veth_namespaces
from test_grpo_multinode import STOP_S, TwoNodes, assert_node1_clean, records, small, step_done, wait_for

DRY = os.environ.get("ASYNCRL_NETNS_DRY_RUN") == "cpu"
kind, ids = detect("auto")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not DRY and (kind != "cuda" or len(ids) < 2), reason="needs two CUDA devices"),
]
AS_HOSTS = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "ar",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
}
"""NCCL as between two hosts: no shared memory, no peer-to-peer, sockets on the veth pair (whose
interfaces are named ar...; multinode_support.veth_namespaces). NCCL's NVLS variables are left as
the machine sets them."""


def node_env(gpu: int) -> dict[str, str]:
    return {} if DRY else {"CUDA_VISIBLE_DEVICES": str(gpu), **AS_HOSTS}


def gpu_args(run_dir, *extra: str) -> list[str]:
    device = ["--run.device", "cpu"] if DRY else []
    return [*small(run_dir, "--trainer.world_size", "1", *extra), *device, "--run.check_weights", "true"]


@pytest.fixture
def node1():
    with veth_namespaces(1) as (made,):
        yield made


def test_the_example_runs_with_its_sampler_on_another_host_over_nccls_sockets(model_path, node1, tmp_path):
    namespace, master, _ = node1
    run_dir = tmp_path / "run"
    run = TwoNodes(
        tmp_path,
        namespace,
        master,
        ["--model_path", model_path, "--run.placement", "trainer=0 sampler=1", "--run.steps", "4", *gpu_args(run_dir)],
        "hosts",
        env0=node_env(0),
        env1=node_env(1),
    )
    try:
        assert run.finish(600) == 0, run.output()[-4000:] + agent_log(str(run.log_dir), 1)[-3000:]
        assert run.agent.wait(30) == 0, agent_log(str(run.log_dir), 1)[-3000:]
    finally:
        run.close()
    out = run.output()
    assert f"sampler0 on node 1; the weight-sync group meets at {master}" in out, out[-4000:]
    rs = records(run_dir)
    assert [r["step"] for r in rs] == [1, 2, 3, 4]
    assert all(r["weights_digests"]["sampler0"] == r["weights_digests"]["trainer"] for r in rs)
    if not DRY:
        assert "GPU 0 the trainer, GPU 1 a sampler" in out, out[-4000:]
        assert "via NET/Socket" in out and " via P2P" not in out and " via SHM" not in out, out[-6000:]
    assert wait_until(lambda: not netns_pids(namespace), 10.0), netns_pids(namespace)


def test_losing_the_samplers_host_stops_the_run_resumably_and_it_resumes(model_path, node1, tmp_path):
    namespace, master, _ = node1
    run_dir = tmp_path / "run"
    args = [
        "--model_path",
        model_path,
        "--run.placement",
        "trainer=0 sampler=1",
        "--run.steps",
        "6",
        *gpu_args(run_dir, "--run.checkpoint_every", "2"),
    ]
    run = TwoNodes(tmp_path, namespace, master, args, "lose", env0=node_env(0), env1=node_env(1))
    try:
        wait_for(lambda: step_done(run_dir) >= 3 or run.driver.poll() is not None, "step 3", run, 600)
        assert run.driver.poll() is None, run.output()[-4000:]
        pids = run.kill_node1()
        lost_at = time.monotonic()
        code = run.finish(STOP_S + 60)
        stopped_s = time.monotonic() - lost_at
        assert_node1_clean(run, pids)
    finally:
        run.close()
    out = run.output()
    print(f"the run stopped {stopped_s:.1f} s after the sampler's host was lost")  # shown with -rP
    assert code == 1, out[-4000:]
    assert "node 1" in out and "lost" in out and "--resume run" in out, out[-4000:]

    resumed = TwoNodes(
        tmp_path, namespace, master, ["--resume", str(run_dir)], "resume", env0=node_env(0), env1=node_env(1)
    )
    try:
        assert resumed.finish(600) == 0, resumed.output()[-4000:]
        assert resumed.agent.wait(30) == 0
    finally:
        resumed.close()
    rs = records(run_dir)
    assert [r["step"] for r in rs] == list(range(1, 7))
    assert all(r["weights_digests"]["sampler0"] == r["weights_digests"]["trainer"] for r in rs[-2:])
