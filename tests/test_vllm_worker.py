"""vLLM's side of weight sync without vLLM: the worker extension driven on a stand-in worker (the
control-value checks, the checkpoint check, both ways of loading, the GPU path included, a sync
over gloo between threads, errors answered by type), and the janitor that cleans up after an
engine. These run everywhere, vLLM installed or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import torch

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.weights import SyncStats, WeightSender

HOST = "127.0.0.1"

pytestmark = pytest.mark.timeout(300)


# --- the worker extension without vLLM (its GPU path included, on a stand-in model) ----------------


class _Model(torch.nn.Module):
    """Stands in for a vLLM model: takes checkpoint-named tensors through load_weights."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        self.state = {k: torch.zeros_like(v) for k, v in state.items()}
        self.calls: list[list[str]] = []

    def load_weights(self, weights):
        names = []
        for name, tensor in weights:
            self.state[name].copy_(tensor)
            names.append(name)
        self.calls.append(names)
        return set(names)


class _Runner:
    def __init__(self, model: _Model, path: str):
        self.model = model
        self.model_config = type("ModelConfig", (), {"model": path})()

    def get_model(self) -> _Model:
        return self.model

    def reload_weights(self, weights_iterator):  # as vLLM's: pulls every tensor, then returns
        self.model.load_weights(weights_iterator)


def _worker(state, path: str, in_place: bool):
    from asyncrl.rl.sampler.vllm.worker import WeightSyncExtension

    class StandIn(WeightSyncExtension):
        device = torch.device("cpu")

        def _asyncrl_loads_in_place(self) -> bool:
            return in_place

    w = StandIn()
    w.model_runner = _Runner(_Model(state), path)
    return w


def _checkpoint(path, state) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"tie_word_embeddings": True}, f)


def _sync(
    worker, sent: dict[str, torch.Tensor], versions: int, delta: bool = False, positions: dict | None = None
) -> tuple[dict, list[SyncStats]]:
    """Send ``versions`` syncs (every tensor + 1.0 each time; with ``delta``, one element of each,
    as delta syncs) over gloo from a thread to ``worker``; returns what was sent last (and its
    digest) and the worker's stats of each sync; ``positions``: what the worker must say of its
    runner's requests (None: a runner that keeps no table)."""
    import threading

    from asyncrl.comm.member import make_communicator
    from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
    from asyncrl.rl.digest import tensor_digest

    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    results: dict = {}

    def sender() -> None:
        group = StoreGroup.create(HOST, port, 0, 2, 30.0, listener=listener)
        comm = make_communicator(group, "gloo", 30.0)
        try:
            s = WeightSender.create(comm, group, sent, bucket_bytes=64 << 10, timeout_s=30.0, delta=delta)
            for version in range(1, versions + 1):
                for t in sent.values():
                    (t.view(-1)[:1] if delta else t).add_(1.0)
                s.send(version)
            results["sent"] = {k: v.clone() for k, v in sent.items()}
            results["digest"] = tensor_digest(results["sent"])
        finally:
            comm.close()
            group.close()

    thread = threading.Thread(target=sender)
    thread.start()
    address = SyncAddress(host=HOST, port=port, world_size=2, backend="gloo", timeout_s=30.0)
    assert worker.asyncrl_join(msgspec.to_builtins(address), 1) == "gloo"
    assert worker.asyncrl_setup_receiver(30.0) >= 1
    stats = []
    for version in range(1, versions + 1):
        answer = worker.asyncrl_receive_weights(version)
        stats.append(msgspec.convert(answer["stats"], SyncStats))  # plain values cross vLLM
        assert answer["positions"] == positions
    thread.join(30)
    return results, stats


@pytest.mark.parametrize("in_place", [True, False], ids=["load_weights (GPU path)", "reload_weights (CPU path)"])
def test_the_worker_extension_receives_over_gloo(tmp_path, in_place):
    g = torch.Generator().manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g),  # larger than a 64 KiB bucket
        "model.norm.weight": torch.randn(64, generator=g),
        "lm_head.weight": torch.randn(300, 64, generator=g),
    }
    _checkpoint(tmp_path / "ckpt", state)
    sent = {k: v.clone() for k, v in state.items() if k != "lm_head.weight"}  # tied: sent once
    worker = _worker(sent, str(tmp_path / "ckpt"), in_place)
    results, stats = _sync(worker, sent, 2)
    for version, s in enumerate(stats, 1):
        assert s.seconds > 0 and s.bytes == sum(t.nbytes for t in sent.values())
        assert 0 < s.copy_s <= s.seconds and s.version == version  # the model's load, in the copies
    model = worker.model_runner.model
    for name, t in results["sent"].items():
        assert torch.equal(model.state[name], t), name
    if in_place:
        assert all(len(c) == 1 for c in model.calls)  # one tensor at a time, as they arrive
    else:
        assert [len(c) for c in model.calls] == [2, 2]  # one reload per sync, pulling every tensor
    assert worker.asyncrl_created().get("gloo", 0) >= 2
    from asyncrl.rl.sampler.errors import WeightsUnreadableError

    why = "model.embed_tokens.weight: no parameter of the model holds it" if in_place else "vLLM on the CPU repacks"
    with pytest.raises(WeightsUnreadableError, match=why):  # --run.check_weights: the refusal names the reason
        worker.asyncrl_digest()
    answer = worker.asyncrl_call("digest")  # typed through vLLM, so the driver stops the run rather than restart
    assert answer["error"] == "asyncrl.rl.sampler.errors.WeightsUnreadableError" and why in answer["message"]
    worker.asyncrl_leave()
    worker.asyncrl_leave()  # idempotent
    with pytest.raises(Exception, match="before joining"):
        worker.asyncrl_receive_weights(3)


@pytest.mark.parametrize("in_place", [True, False], ids=["load_weights (GPU path)", "reload_weights (CPU path)"])
def test_the_worker_extension_takes_delta_syncs_from_the_copy_it_keeps(tmp_path, in_place):
    """Issue 50: the engine's loaders take whole tensors, so the worker's receiver keeps a copy of
    what it was sent, patches it with each delta and hands every tensor on from it."""
    g = torch.Generator().manual_seed(1)
    state = {"model.embed_tokens.weight": torch.randn(300, 64, generator=g), "model.norm.weight": torch.randn(64)}
    _checkpoint(tmp_path / "ckpt", {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()})
    worker = _worker({k: v.clone() for k, v in state.items()}, str(tmp_path / "ckpt"), in_place)
    results, stats = _sync(worker, state, 3, delta=True)
    assert [s.delta for s in stats] == [False, True, True]
    assert all(s.sent_bytes < 1000 for s in stats[1:]), stats  # two changed words a sync, not 77 kB
    for name, t in results["sent"].items():
        assert torch.equal(worker.model_runner.model.state[name], t), name
    worker.asyncrl_leave()


class _FusedModel(torch.nn.Module):
    """Stands in for a vLLM model that fuses checkpoint tensors as vLLM's Qwen2 does (q/k/v into
    ``qkv_proj``, gate/up into ``gate_up_proj``, stacked along dim 0), with a loader that finds each
    tensor's place by name on every call. ``norm_offset``: a loader that stores the norm's weight
    minus 1 (as a model computing ``1 + w`` would), which no place computed from names can match."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, hidden: int, q: int, kv: int, ffn: int, vocab: int, norm_offset: bool = False, pad: int = 0):
        super().__init__()
        self.sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": ffn, "up_proj": ffn}
        p = torch.nn.Parameter
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        layer.self_attn.qkv_proj = torch.nn.Module()
        layer.self_attn.qkv_proj.weight = p(torch.zeros(q + 2 * kv, hidden), requires_grad=False)
        layer.self_attn.qkv_proj.bias = p(torch.zeros(q + 2 * kv), requires_grad=False)
        layer.mlp.gate_up_proj = torch.nn.Module()
        layer.mlp.gate_up_proj.weight = p(torch.zeros(2 * ffn, hidden), requires_grad=False)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = p(torch.zeros(hidden), requires_grad=False)
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = p(torch.zeros(vocab + pad, hidden), requires_grad=False)  # vLLM pads to 64
        self.norm_offset = norm_offset
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        params = dict(self.named_parameters())
        for name, tensor in weights:
            for fused, members in self.packed_modules_mapping.items():
                member = next((m for m in members if f".{m}." in name), None)
                if member is not None:
                    at = sum(self.sizes[m] for m in members[: members.index(member)])
                    params[name.replace(member, fused)].data.narrow(0, at, self.sizes[member]).copy_(tensor)
                    break
            else:  # as vLLM's vocabulary loader: the checkpoint's rows first, the padding left
                value = tensor - 1 if self.norm_offset and name == "model.norm.weight" else tensor
                params[name].data.narrow(0, 0, len(tensor)).copy_(value)


def _fused_state(g: torch.Generator) -> dict[str, torch.Tensor]:
    h, q, kv, ffn, vocab = 16, 16, 8, 32, 40
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    shapes = {
        f"{attn}.q_proj.weight": (q, h),
        f"{attn}.k_proj.weight": (kv, h),
        f"{attn}.v_proj.weight": (kv, h),
        f"{attn}.q_proj.bias": (q,),
        f"{attn}.k_proj.bias": (kv,),
        f"{attn}.v_proj.bias": (kv,),
        f"{mlp}.gate_proj.weight": (ffn, h),
        f"{mlp}.up_proj.weight": (ffn, h),
        "model.norm.weight": (h,),
        "model.embed_tokens.weight": (vocab, h),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _fused_worker(state, path: str, norm_offset: bool = False, pad: int = 0):
    worker = _worker({}, path, True)
    worker.model_runner.model = _FusedModel(16, 16, 8, 32, 40, norm_offset, pad)
    return worker


def _unfused(model: _FusedModel, names: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors read back out of the fused (and padded) parameters."""
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        for fused, members in model.packed_modules_mapping.items():
            member = next((m for m in members if f".{m}." in name), None)
            if member is not None:
                at = sum(model.sizes[m] for m in members[: members.index(member)])
                out[name] = params[name.replace(member, fused)].narrow(0, at, model.sizes[member])
                break
        else:
            out[name] = params[name][: len(names[name])]
    return out


@pytest.mark.parametrize("pad", [0, 24], ids=["vocabulary as sent", "vocabulary padded by vLLM"])
def test_later_syncs_go_straight_into_the_places_the_first_one_checked(tmp_path, pad):
    """``pad``: vLLM pads a vocabulary to a multiple of 64 rows (the embedded model's byte-level one
    of a few hundred tokens on the GPU, 2026-11-29); the sent rows are the place."""
    g = torch.Generator().manual_seed(1)
    state = _fused_state(g)
    _checkpoint(tmp_path / "ckpt", state)
    worker = _fused_worker(state, str(tmp_path / "ckpt"), pad=pad)
    sent = {k: v.clone() for k, v in state.items()}
    results, stats = _sync(worker, sent, 3)
    model = worker.model_runner.model
    assert model.calls >= 1 and worker._asyncrl.views is not None
    calls_in_first_sync = model.calls
    for name, t in _unfused(model, sent).items():
        assert torch.equal(t, results["sent"][name]), name  # version 3, which no loader call wrote
    assert model.calls == calls_in_first_sync  # versions 2 and 3 called no loader
    assert [s.version for s in stats] == [1, 2, 3] and all(s.copy_s > 0 for s in stats)
    assert worker.asyncrl_digest() == results["digest"]  # --run.check_weights reads the places
    assert not model.model.embed_tokens.weight[len(sent["model.embed_tokens.weight"]) :].any()  # padding untouched


def test_a_loader_that_transforms_a_tensor_keeps_the_loader_and_gives_no_digest(tmp_path):
    from asyncrl.rl.sampler.errors import WeightsUnreadableError

    g = torch.Generator().manual_seed(2)
    state = _fused_state(g)
    _checkpoint(tmp_path / "ckpt", state)
    worker = _fused_worker(state, str(tmp_path / "ckpt"), norm_offset=True)
    sent = {k: v.clone() for k, v in state.items()}
    results, _ = _sync(worker, sent, 3)
    model = worker.model_runner.model
    assert worker._asyncrl.views is None
    per_sync = model.calls // 3
    assert per_sync >= 1 and model.calls == 3 * per_sync  # the loader took every sync
    norm = results["sent"]["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, norm - 1)  # the loader's own transform, kept
    with pytest.raises(
        WeightsUnreadableError,
        match=r"not held as the sent tensors \(load_weights put other values .* model\.norm\.weight",
    ):
        worker.asyncrl_digest()  # the refusal says why, as the worker's log does


def test_the_worker_keeps_the_last_loads_positions_for_each_client_of_a_shared_engine(tmp_path):
    """A client of a shared engine asks, after its host's sync, for the version loaded and where
    its own requests stood then (by the marker in their ids): never another client's, and before
    any load a refusal, not a made-up version."""
    from types import SimpleNamespace

    state = {"model.norm.weight": torch.ones(64)}
    _checkpoint(tmp_path / "ckpt", state)
    worker = _worker(dict(state), str(tmp_path / "ckpt"), in_place=True)
    with pytest.raises(Exception, match="no weights were loaded into this engine yet"):
        worker.asyncrl_loaded("asyncrl-0123abcd-")
    running = {"asyncrl-0123abcd-4-x": 3, "1_asyncrl-0123abcd-5-y": 2, "asyncrl-ffffffff-4-z": 9}
    worker.model_runner.requests = {rid: SimpleNamespace(output_token_ids=[0] * n) for rid, n in running.items()}
    _sync(worker, dict(state), 2, positions=running)
    assert worker.asyncrl_call("loaded", "asyncrl-0123abcd-") == {
        "ok": {"version": 2, "positions": {"asyncrl-0123abcd-4-x": 3, "1_asyncrl-0123abcd-5-y": 2}}
    }
    assert worker.asyncrl_call("pid") == {"ok": os.getpid()}


def test_a_digest_before_a_sync_checked_the_places_is_refused_for_now_not_for_good():
    """Between the set-up and the first sync the places are not checked yet: the digest is refused
    as any failed call is (the sampler is judged), not as weights that can never be read (the run
    stops)."""
    from types import SimpleNamespace

    from asyncrl.rl.sampler.errors import WeightsUnreadableError
    from asyncrl.rl.sampler.vllm.worker import WorkerSyncError, _Membership

    worker = _worker({}, "/nonexistent", True)
    worker._asyncrl = _Membership(SimpleNamespace(group=None, comm=None))
    with pytest.raises(WorkerSyncError, match="no sync has checked their places") as refused:
        worker.asyncrl_digest()
    assert not isinstance(refused.value, WeightsUnreadableError)


def test_places_are_refused_for_what_cannot_be_received_into_directly():
    from asyncrl.rl.sampler.vllm.param_views import param_views

    model = _FusedModel(16, 16, 8, 32, 40)
    state = _fused_state(torch.Generator().manual_seed(3))

    def layout(**changes):
        tensors = {**state, **changes}
        return [(n, tuple(t.shape), t.dtype) for n, t in tensors.items() if t is not None]

    views, why = param_views(model, layout())
    assert why == "" and set(views) == set(state)
    k = views["model.layers.0.self_attn.k_proj.weight"]
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert k.data_ptr() == qkv.data_ptr() + 16 * 16 * 4 and k.shape == (8, 16)  # after q's 16 rows
    cases = {
        "model.extra.weight: no parameter of the model holds it": layout(**{"model.extra.weight": torch.zeros(2)}),
        "model.norm.weight: the model's parameter is [16]": layout(**{"model.norm.weight": torch.zeros(17)}),
        "model.norm.weight: the model's parameter is [16], the sender's tensor [15]": layout(
            **{"model.norm.weight": torch.zeros(15)}  # only a vocabulary's rows are padded
        ),
        "not its members": layout(**{"model.layers.0.self_attn.k_proj.weight": torch.zeros(9, 16)}),
        "the model holds torch.float32, the sender sends torch.bfloat16": layout(
            **{"model.norm.weight": torch.zeros(16, dtype=torch.bfloat16)}
        ),
    }
    for message, sent in cases.items():
        views, why = param_views(model, sent)
        assert views is None and message in why, (message, why)
    # a vocabulary vLLM padded: the sent rows are the first ones of the parameter
    views, why = param_views(model, layout(**{"model.embed_tokens.weight": torch.zeros(33, 16)}))
    embed = model.model.embed_tokens.weight
    assert why == "" and views["model.embed_tokens.weight"].shape == (33, 16)
    assert views["model.embed_tokens.weight"].data_ptr() == embed.data_ptr()
    # a fused member whose siblings are not all sent cannot be placed (their sizes are unknown)
    views, why = param_views(model, layout(**{"model.layers.0.self_attn.v_proj.weight": None}))
    assert views is None and "model.layers.0.self_attn.q_proj.weight: no parameter" in why


def test_the_worker_extension_refuses_bad_control_values():
    from asyncrl.rl.sampler.vllm.worker import WorkerSyncError

    worker = _worker({}, "/nonexistent", True)
    good = dict(host=HOST, port=1234, world_size=2, generation=0, backend="gloo", timeout_s=5.0, name="w")
    for bad, match in (
        ({"port": "1234"}, "Expected `int`, got `str` - at `\\$.port`"),
        ({"port": 0}, "only rank 0 picks the port"),
        ({"port": 65536}, "port must be in 0..65535"),
        ({"world_size": 1}, "rank 1 is not in a world of size 1"),
        ({"backend": "mpi"}, "unknown communicator backend 'mpi'"),
        ({"backend": "hccl"}, "backend must be auto, gloo, nccl or ipc in a vLLM worker"),
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
        ({"host": ""}, "host must be a non-empty string"),
        ({"name": 3}, "Expected `str`, got `int` - at `\\$.name`"),
        ({"name": "a/b"}, "group name must be non-empty and contain no '/'"),
        ({"generation": -1}, "generation must be a non-negative int"),
    ):
        with pytest.raises(ValueError, match=match):
            worker.asyncrl_join(good | bad, 1)
    for rank, match in (
        (0, "rank 0 is the sender's"),
        (True, "rank must be a non-negative int"),
        (2, "not in a world"),
    ):
        with pytest.raises(ValueError, match=match):
            worker.asyncrl_join(good, rank)
    with pytest.raises(ValueError, match="Expected `object`, got `str`"):
        worker.asyncrl_join("127.0.0.1:1234", 1)
    with pytest.raises(WorkerSyncError, match="before joining"):
        worker.asyncrl_setup_receiver(5.0)
    with pytest.raises(ValueError, match="version"):
        worker.asyncrl_receive_weights(-1)


def test_a_layout_that_is_not_the_checkpoints_is_refused(tmp_path):
    from asyncrl.comm.errors import LayoutMismatchError
    from asyncrl.comm.layout import build_layout, spec_of
    from asyncrl.rl.sampler.vllm.worker import _check_against_checkpoint

    state = {"a.weight": torch.zeros(4, 3), "b.weight": torch.zeros(5), "lm_head.weight": torch.zeros(7, 3)}
    _checkpoint(tmp_path, {**state, "model.embed_tokens.weight": torch.zeros(7, 3)})

    def layout(tensors):
        return build_layout([spec_of(n, t) for n, t in tensors.items()], 1 << 20)

    tied_ok = {
        "a.weight": state["a.weight"],
        "b.weight": state["b.weight"],
        "model.embed_tokens.weight": torch.zeros(7, 3),
    }
    _check_against_checkpoint(layout(tied_ok), str(tmp_path))  # lm_head tied to the embedding: not sent
    with pytest.raises(LayoutMismatchError, match="b.weight: in the checkpoint, never sent"):
        _check_against_checkpoint(layout({k: v for k, v in tied_ok.items() if k != "b.weight"}), str(tmp_path))
    with pytest.raises(LayoutMismatchError, match=r"a.weight: sender has \[3, 4\]"):
        _check_against_checkpoint(layout(tied_ok | {"a.weight": torch.zeros(3, 4)}), str(tmp_path))
    with pytest.raises(LayoutMismatchError, match="c.weight: not in the checkpoint"):
        _check_against_checkpoint(layout(tied_ok | {"c.weight": torch.zeros(1)}), str(tmp_path))


def test_the_pulled_loader_reports_a_failure_and_never_hangs():
    from asyncrl.rl.sampler.vllm.worker import WorkerSyncError, _PulledLoad

    def failing(weights):
        next(iter(weights))
        raise RuntimeError("bad weight")

    load = _PulledLoad(failing, total=3, timeout_s=5.0, depth=1)
    load("a", torch.zeros(2))
    with pytest.raises(WorkerSyncError, match="bad weight"):
        for name in ("b", "c"):
            load(name, torch.zeros(2))
            time.sleep(0.2)
    load.close()

    stuck = _PulledLoad(lambda weights: time.sleep(3), total=2, timeout_s=0.5, depth=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        for name in ("a", "b"):
            stuck(name, torch.zeros(2))
    assert time.monotonic() - start < 3.0
    stuck.close()

    seen = []
    partial = _PulledLoad(lambda weights: seen.extend(weights), total=3, timeout_s=5.0)
    partial("a", torch.zeros(1))  # the receiver gives up after one tensor: the loader ends, raising
    partial.close()
    assert isinstance(partial.error, WorkerSyncError) and [n for n, _ in seen] == ["a"]


def test_the_worker_answers_data_plane_errors_by_type_and_raises_the_rest():
    from asyncrl.comm.rendezvous import reserve_listener
    from asyncrl.rl.sampler.vllm.worker import WorkerSyncError

    worker = _worker({}, "/nonexistent", True)
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    listener.close()  # nobody hosts the store there: the join times out, a data-plane error
    address = SyncAddress(host=HOST, port=port, world_size=2, backend="gloo", timeout_s=1.0)
    answer = worker.asyncrl_call("join", msgspec.to_builtins(address), 1)
    assert answer["error"] == "asyncrl.comm.errors.RendezvousTimeoutError", answer
    assert "rank(s) [0]" in answer["message"], answer
    assert worker.asyncrl_call("created") == {"ok": worker.asyncrl_created()}
    with pytest.raises(WorkerSyncError, match="before joining"):  # this worker's own state: raised as it is
        worker.asyncrl_call("setup_receiver", 5.0)
    with pytest.raises(WorkerSyncError, match="no weight-sync call"):
        worker.asyncrl_call("__init__")


def test_the_janitor_cleans_up_after_an_actor_that_died_before_its_engine_was_up(tmp_path):
    from asyncrl.rl.sampler.vllm.janitor import Janitor

    early = tmp_path / "early"
    early.mkdir()
    janitor = Janitor(str(early))
    janitor.proc.stdin.close()  # what the actor's death does to the pipe
    assert janitor.proc.wait(10) == 0 and not early.exists()

    # An engine killed while it starts: the janitor has been told of the segments its processes
    # mapped so far (a child of ours stands in for vLLM's engine core here).
    from asyncrl.rl.sampler.vllm.janitor import shm_names

    starting = tmp_path / "starting"
    starting.mkdir()
    janitor = Janitor(str(starting))
    followed = janitor.follow(shm_names(), poll_s=0.05)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys, time
        from multiprocessing import shared_memory, resource_tracker
        shm = shared_memory.SharedMemory(create=True, size=1 << 20)
        resource_tracker.unregister(shm._name, "shared_memory")  # as if killed: nobody cleans up
        print(shm.name, flush=True)
        time.sleep(60)"""),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    name = child.stdout.readline().strip().lstrip("/")
    time.sleep(0.5)  # several polls
    child.kill()
    child.wait()
    assert os.path.exists(os.path.join("/dev/shm", name))
    janitor.proc.stdin.close()  # the actor dies before followed() is ever called
    assert janitor.proc.wait(10) == 0 and not starting.exists()
    assert not os.path.exists(os.path.join("/dev/shm", name)), "the segment of an engine killed while starting was left"
    followed()  # stops the polling thread (in real life it died with the actor)

    late, segment = tmp_path / "late", f"asyncrl-test-{os.getpid()}"
    late.mkdir()
    open(os.path.join("/dev/shm", segment), "wb").close()
    janitor = Janitor(str(late))
    janitor.watch([segment])
    janitor.finish()
    assert janitor.proc.returncode == 0 and not late.exists() and not os.path.exists(os.path.join("/dev/shm", segment))


def test_the_janitor_removes_the_loky_semaphores_of_the_engines_processes_only(tmp_path):
    """torch.compile's process pool (loky) names its semaphores after the process that made them,
    at any time after the engine started: the janitor removes those of the processes it was told
    of, and no other's."""
    from asyncrl.rl.sampler.vllm.janitor import Janitor

    ours, theirs = f"sem.loky-{os.getpid() + 4_000_000}-abc", f"sem.loky-{os.getpid() + 4_000_001}-abc"
    for name in (ours, theirs):
        open(os.path.join("/dev/shm", name), "wb").close()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    janitor = Janitor(str(scratch))
    janitor.watch([f"pid:{os.getpid() + 4_000_000}"])
    try:
        janitor.finish()
        assert not os.path.exists(os.path.join("/dev/shm", ours))
        assert os.path.exists(os.path.join("/dev/shm", theirs))
    finally:
        for name in (ours, theirs):
            if os.path.exists(os.path.join("/dev/shm", name)):
                os.unlink(os.path.join("/dev/shm", name))


def test_the_janitor_leaves_a_semaphore_another_living_process_holds(tmp_path):
    """On a shared host a multiprocessing semaphore that appeared while our engine started may be
    another engine's, still in use: removing it broke that engine's start (its worker could not
    open the semaphore; seen when one run's sampler ended as another run's engine started). The
    janitor removes only what no living process but ours maps. A real semaphore: glibc maps it
    under a temporary name, so only its inode ties the mapping to its name."""
    from asyncrl.rl.sampler.vllm.janitor import Janitor

    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import multiprocessing, time
        lock = multiprocessing.get_context("spawn").Lock()
        print("sem." + lock._semlock.name.lstrip("/"), flush=True)
        time.sleep(60)"""),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    path = ""
    try:
        name = other.stdout.readline().strip()
        path = os.path.join("/dev/shm", name)
        assert name.startswith("sem.mp-") and os.path.exists(path), name
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        janitor = Janitor(str(scratch))
        janitor.watch([name])
        janitor.finish()
        assert os.path.exists(path) and not scratch.exists()
    finally:
        other.kill()
        other.wait()
        if path and os.path.exists(path):
            os.unlink(path)


def test_the_engines_processes_keep_torch_compiles_cache_and_the_janitor_leaves_it(tmp_path):
    """An engine's processes run with ``TMPDIR`` at its scratch directory; torch.compile's cache
    (its C++ header precompiled on CPU among it: ~12 s of each engine's first generate when it was
    rebuilt) is found through the link `keep_compile_cache` leaves there, by torch's own lookup in a
    process started as vLLM starts its engine core, and survives the janitor."""
    from asyncrl.rl.sampler.vllm.janitor import Janitor, keep_compile_cache

    shared, scratch = tmp_path / "cache", tmp_path / "scratch"
    scratch.mkdir()
    keep_compile_cache(str(scratch), str(shared))
    (shared / "precompiled_headers").mkdir()
    lookup = "from torch._inductor.runtime.cache_dir_utils import default_cache_dir; print(default_cache_dir())"
    seen = subprocess.run(
        [sys.executable, "-c", lookup],
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert os.path.dirname(seen) == str(scratch)
    assert os.path.isdir(os.path.join(seen, "precompiled_headers"))
    janitor = Janitor(str(scratch))
    janitor.finish()
    assert not scratch.exists() and (shared / "precompiled_headers").is_dir()


def test_only_the_reload_warnings_of_layers_no_checkpoint_loads_are_silenced():
    """vLLM's in-place reload warns "<layer>: Failed to load weights" on every sync for a rotary
    embedding (a computed, non-persistent buffer) and a head tied to the embedding (never sent):
    those two are silenced, a layer that really was not loaded still warns."""
    import logging

    from asyncrl.rl.sampler.vllm.compat import RELOAD_TIMING_LOGGER
    from asyncrl.rl.sampler.vllm.reload_warnings import (
        RELOAD_LOGGER,
        RELOAD_TIMING,
        RELOAD_WARNING,
        quiet_reload_warnings,
    )

    class RotaryEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4), persistent=False)

    class Norm(torch.nn.Module):  # its buffer is saved in a checkpoint: a missing one must warn
        def __init__(self):
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(4))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(8, 4)
            self.rotary = RotaryEmbedding()
            self.norm = Norm()
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.embed_tokens.weight  # tied

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger, timing = logging.getLogger(RELOAD_LOGGER), logging.getLogger(RELOAD_TIMING_LOGGER)
    handler, filters, timing_filters = Keep(), list(logger.filters), list(timing.filters)
    logger.addHandler(handler)
    timing.addHandler(handler)
    try:
        quiet_reload_warnings(Model(), {"embed_tokens.weight"})
        for layer in ("RotaryEmbedding", "Linear", "Norm", "Embedding"):
            logger.warning(RELOAD_WARNING, layer)
        assert records == ["Norm: Failed to load weights", "Embedding: Failed to load weights"]

        records.clear()  # the head itself was sent: it was not tied to anything sent, so it warns
        quiet_reload_warnings(Model(), {"lm_head.weight"})
        logger.warning(RELOAD_WARNING, "Linear")
        logger.warning(RELOAD_WARNING, "RotaryEmbedding")
        assert records == ["Linear: Failed to load weights"]

        records.clear()  # the per-sync timing line goes too; the module's other lines stay
        timing.warning(RELOAD_TIMING, 0.02)
        timing.warning("Reloading with `is_checkpoint_format=True` requires ...")
        assert records == ["Reloading with `is_checkpoint_format=True` requires ..."]
    finally:
        logger.removeHandler(handler)
        timing.removeHandler(handler)
        logger.filters[:] = filters  # this process hosts no engine: leave its loggers as they were
        timing.filters[:] = timing_filters


def test_the_workers_data_plane_errors_come_back_under_their_own_type():
    from asyncrl.comm.errors import CollectiveError, LayoutMismatchError, RendezvousError
    from asyncrl.rl.sampler.errors import WeightsUnreadableError
    from asyncrl.rl.sampler.vllm.sink import EngineWeightSyncError, worker_error

    assert worker_error("asyncrl.comm.errors.CollectiveError") is CollectiveError
    assert worker_error("asyncrl.comm.errors.LayoutMismatchError") is LayoutMismatchError
    # Its constructor takes (group, what, missing, timeout_s), not a message: its base class does.
    assert worker_error("asyncrl.comm.errors.RendezvousTimeoutError") is RendezvousError
    assert worker_error("asyncrl.comm.errors.NoSuchError") is EngineWeightSyncError
    # By path, not by name: another module's class of the same name is not ours.
    assert worker_error("CollectiveError") is EngineWeightSyncError
    assert worker_error("elsewhere.CollectiveError") is EngineWeightSyncError
    assert (
        worker_error("asyncrl.rl.sampler.errors.WeightsUnreadableError") is WeightsUnreadableError
    )  # a refused digest


async def test_the_engine_sinks_pause_and_transfer_share_one_deadline():
    """The worker's transfer gets what the pause left of the sync's deadline, not a whole one."""
    import asyncio

    from asyncrl.rl.sampler.vllm.sink import EngineSink

    calls = []

    class Engine:  # stands in for vLLM's AsyncLLM
        async def collective_rpc(self, method, timeout, args):
            calls.append(args)
            return [{"ok": {"stats": {"version": 7, "bytes": 100, "buckets": 1, "seconds": 0.01}, "positions": {}}}]

    class Backend:
        engine, prefix_caching, paused, changed = Engine(), False, [], []

        async def pause(self, timeout_s):
            self.paused.append(timeout_s)
            await asyncio.sleep(0.3)  # the batch in flight takes this long to finish

        async def resume(self):
            self.paused.append("resumed")

        def request_mark(self):
            return 5  # the number of the next request it would send

        def weights_changed(self, version, positions, since):
            self.changed.append((version, positions, since))

    backend = Backend()
    stats = await EngineSink(backend).receive(7, in_flight=False, timeout_s=1.0)
    [(call, version, timeout_s)] = calls
    assert (call, version) == ("receive_weights", 7) and backend.paused == [1.0, "resumed"]
    assert stats.pause_s >= 0.3 and 0 < timeout_s <= 0.7 + 1e-3
    assert stats.receive.seconds == 0.01 and stats.receive.bytes == 100 and stats.reset_s == 0.0
    assert backend.changed == [(7, {}, 5)]  # paused: no request ran across the load


async def test_the_engine_sink_times_the_pause_the_load_the_reset_and_the_resume():
    """Each phase of a vLLM sampler's sync lands in its own field: the worker's own receive, the
    control call around it, the prefix-cache reset and the resume."""
    import asyncio

    from asyncrl.rl.sampler.vllm.sink import EngineSink, EngineWeightSyncError

    class Engine:
        answer: object = {
            "stats": {"version": 3, "bytes": 64, "buckets": 1, "seconds": 0.05, "copy_s": 0.04},
            "positions": {"0_asyncrl-0123abcd-5-x": 2},
        }

        async def collective_rpc(self, method, timeout, args):
            await asyncio.sleep(0.15)  # the worker's 0.05 s, and a slow round trip
            return [{"ok": self.answer}]

        async def reset_prefix_cache(self):
            await asyncio.sleep(0.1)
            return True

    class Backend:
        engine, prefix_caching, changed = Engine(), True, []

        async def pause(self, timeout_s):
            await asyncio.sleep(0.2)

        async def resume(self):
            await asyncio.sleep(0.05)

        def request_mark(self):
            return 6

        def weights_changed(self, version, positions, since):
            self.changed.append((version, positions, since))

    backend = Backend()
    stats = await EngineSink(backend).receive(3, in_flight=False, timeout_s=5.0)
    assert stats.pause_s >= 0.2 and stats.reset_s >= 0.1 and stats.resume_s >= 0.05
    assert stats.call_s >= 0.09 and stats.receive.copy_s == 0.04
    assert abs(stats.load_s - (0.04 + stats.reset_s)) < 1e-9
    in_flight = await EngineSink(backend).receive(3, in_flight=True, timeout_s=5.0)
    assert in_flight.pause_s == in_flight.call_s >= 0.09  # in flight, the wait is the engine's taking the call
    # where requests stood: in flight only; and the mark of the requests sent after the load was asked
    assert backend.changed == [(3, {}, 6), (3, {"0_asyncrl-0123abcd-5-x": 2}, 6)]
    backend.engine.answer = [0.05, 64.0]  # an older worker's answer: a typed error, not a crash later
    with pytest.raises(EngineWeightSyncError, match="answered"):
        await EngineSink(backend).receive(4, in_flight=False, timeout_s=5.0)


def test_an_engines_processes_exit_without_a_last_garbage_collection(tmp_path):
    """`engine_exit.plugin` (a vLLM general plugin) in a process an engine's starter spawned: the
    heap is frozen at exit, so the interpreter's last collections scan nothing (a cycle's
    finaliser does not run: the mark); in the starter itself, and without a starter, it does
    nothing (the cycle is collected at exit as usual). And the entry point that has vLLM call it
    is installed (else: reinstall asyncrl, ``pip install -e .``)."""
    from importlib.metadata import entry_points

    from asyncrl.rl.sampler.vllm.engine_exit import STARTER

    script = textwrap.dedent(f"""
        import gc, os, sys
        gc.disable()  # no collection before exit (the cycle is too small to trigger one anyway)
        if sys.argv[2] == "self":
            os.environ["{STARTER}"] = str(os.getpid())
        from asyncrl.rl.sampler.vllm.engine_exit import plugin
        plugin()
        plugin()  # vLLM may load plugins twice
        class Cycle:
            def __del__(self, path=sys.argv[1], os=os):  # bound now: finalisation clears modules
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY))
        c = Cycle()
        c.me = c
        del c
    """)

    def collected_at_exit(starter: str) -> bool:
        mark = tmp_path / starter
        env = {k: v for k, v in os.environ.items() if k != STARTER}
        if starter == "parent":
            env[STARTER] = str(os.getpid())
        subprocess.run([sys.executable, "-c", script, str(mark), starter], env=env, check=True, timeout=60)
        return mark.exists()

    assert not collected_at_exit("parent")  # an engine's process: frozen
    assert collected_at_exit("self") and collected_at_exit("none")
    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "asyncrl.rl.sampler.vllm.engine_exit:plugin" in plugins, f"not installed (pip install -e .): {plugins}"
