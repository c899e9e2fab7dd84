"""`asyncrl.comm.join`: the one way a member forms (or, next generation, rebuilds) its group and
communicator, and the backend factory under it. Members run on threads of this process over gloo."""

from __future__ import annotations

import threading
import types

import msgspec
import pytest
import torch

import asyncrl.comm.join as join_mod
from asyncrl.comm.address import SyncAddress
from asyncrl.comm.communicator import Communicator
from asyncrl.comm.errors import RendezvousError
from asyncrl.comm.join import SyncMembership, join_sync_group, make_communicator, resolve_backend
from asyncrl.comm.member import make_communicator as make_communicator_of_member
from asyncrl.comm.rendezvous import StoreGroup, reserve_listener

HOST = "127.0.0.1"


def join_members(world_size: int, generation: int = 0, timeout_s: float = 20.0) -> list[SyncMembership]:
    """Every rank calls join_sync_group at once, on its own thread; rank 0 on a reserved listener."""
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    address = SyncAddress(
        host=HOST, port=port, world_size=world_size, generation=generation, backend="auto", timeout_s=timeout_s
    )
    results: list = [None] * world_size

    def member(rank: int) -> None:
        try:
            results[rank] = join_sync_group(address, rank, device="cpu", listener=listener if rank == 0 else None)
        except BaseException as exc:  # noqa: BLE001  (raised below, in the test thread)
            results[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a member hung"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_auto_picks_the_backend_of_the_device():
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 3)) == "nccl"
    assert resolve_backend("auto", "npu:1") == "hccl"
    assert resolve_backend("auto", "meta") == "gloo"
    for name in ("nccl", "hccl", "gloo"):
        assert resolve_backend(name, "cpu") == name  # an explicit choice stands


def test_auto_without_a_device_picks_nccl_only_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto") == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto") == "gloo"


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown communicator backend 'mpi' \(auto, nccl, hccl, gloo, ipc\)"):
        resolve_backend("mpi")


def test_an_address_is_checked_where_it_is_built_and_where_it_is_decoded():
    good = dict(host=HOST, port=1234, world_size=3, generation=2, backend="gloo", timeout_s=5.0, name="w")
    address = SyncAddress(**good)
    assert address.label == "w/g2"
    wire = msgspec.msgpack.encode(address)  # as an endpoint's argument travels
    assert msgspec.msgpack.decode(wire, type=SyncAddress) == address
    assert msgspec.convert(msgspec.to_builtins(address), SyncAddress) == address  # as it crosses vLLM's rpc
    for bad, match in (
        ({"port": -1}, "port must be a non-negative int"),
        ({"generation": True}, "generation must be a non-negative int|Expected `int`, got `bool`"),
        ({"port": 70000}, r"port must be in 0\.\.65535"),
        ({"world_size": 0}, "world_size must be at least 1"),
        ({"backend": "mpi"}, "unknown communicator backend 'mpi'"),
        ({"timeout_s": -1.0}, "timeout_s must be a positive number"),
        ({"name": ""}, "group name must be non-empty"),
        ({"host": ""}, "host must be a non-empty string"),
    ):
        with pytest.raises(ValueError, match=match):
            SyncAddress(**(good | bad))
        with pytest.raises(msgspec.ValidationError, match=match):  # a ValueError too
            msgspec.msgpack.decode(msgspec.msgpack.encode(good | bad), type=SyncAddress)
    address.check_rank(2)
    for rank, match in ((3, "rank 3 is not in a world of size 3"), (-1, "not in a world"), (True, "must be an int")):
        with pytest.raises(ValueError, match=match):
            address.check_rank(rank)
    with pytest.raises(ValueError, match="only rank 0 picks the port"):
        SyncAddress(**(good | {"port": 0})).check_rank(1)
    SyncAddress(**(good | {"port": 0})).check_rank(0)


def test_member_still_exports_the_factory():
    assert make_communicator_of_member is make_communicator


def test_members_form_a_group_whose_communicator_works():
    before = Communicator.created["gloo"]
    members = join_members(2, generation=3)
    try:
        assert [m.backend for m in members] == ["gloo", "gloo"]
        assert [(m.group.rank, m.group.world_size, m.group.label) for m in members] == [
            (0, 2, "weights/g3"),
            (1, 2, "weights/g3"),
        ]
        assert [m.comm.group for m in members] == ["weights/g3", "weights/g3"]
        assert Communicator.created["gloo"] == before + 2
        tensors = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
        works = [m.comm.all_reduce(t) for m, t in zip(members, tensors)]
        for work in works:
            work.wait(10)
        assert tensors[0].tolist() == tensors[1].tolist() == [11.0, 22.0]
    finally:
        for m in members:
            m.close()
    assert all(m.comm.closed for m in members)
    for m in members:
        m.close()  # idempotent


def test_rendezvous_and_communicator_share_one_deadline(monkeypatch):
    clock = [100.0]
    seen: dict = {}

    class SlowGroup:
        closed = False

        @classmethod
        def create(cls, host, port, rank, world_size, timeout_s, *, name, generation, listener):
            seen["group"] = (host, port, rank, world_size, timeout_s, name, generation, listener)
            clock[0] += 7.0  # the rendezvous took 7 s of the 10
            return cls()

        def close(self):
            self.closed = True

    def fake_make_communicator(group, backend, timeout_s, *, device):
        seen["comm"] = (backend, timeout_s, device)
        return types.SimpleNamespace(backend="gloo", close=lambda: None)

    monkeypatch.setattr(join_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(join_mod, "StoreGroup", SlowGroup)
    monkeypatch.setattr(join_mod, "make_communicator", fake_make_communicator)
    address = SyncAddress(host="h", port=1234, world_size=2, generation=4, backend="nccl", timeout_s=10.0, name="w")
    membership = join_sync_group(address, 1, device="cuda:1")
    assert seen["group"] == ("h", 1234, 1, 2, 10.0, "w", 4, None)
    assert seen["comm"] == ("nccl", pytest.approx(3.0), "cuda:1")
    assert membership.backend == "gloo"


def test_a_communicator_that_fails_leaves_no_group_open(monkeypatch):
    groups: list[StoreGroup] = []
    real_create = StoreGroup.create

    def recording_create(*args, **kwargs):
        groups.append(real_create(*args, **kwargs))
        return groups[-1]

    def failing_make_communicator(group, backend, timeout_s, *, device):
        raise RuntimeError("no communicator today")

    monkeypatch.setattr(join_mod.StoreGroup, "create", recording_create)
    monkeypatch.setattr(join_mod, "make_communicator", failing_make_communicator)
    with pytest.raises(RuntimeError, match="no communicator today"):
        join_sync_group(SyncAddress(host=HOST, port=0, world_size=1, timeout_s=10.0), 0)
    assert len(groups) == 1
    with pytest.raises(RendezvousError, match="already closed its store"):
        groups[0].barrier()
