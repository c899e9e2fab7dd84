"""Errors that cross processes as themselves: every `AsyncrlError` subclass registers itself, so an
endpoint's error is caught by its type in the caller (also a `RemoteError`), never by its name as a
string; a name the caller does not know stays a plain `RemoteError`, and nothing is imported by it."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from actors import RaisesOurs
from asyncrl import RemoteError, Supervisor
from asyncrl.comm.errors import CollectiveError, RendezvousError, RendezvousTimeoutError, WeightSyncError
from asyncrl.errors import _KNOWN, ActorError, AsyncrlError, remote_error_class, type_path
from asyncrl.rl.checkpoint import CheckpointWriteError
from asyncrl.rl.driver.fleet.sync_group import suffered_from_peer
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRankFailedError, TrainerRanks
from asyncrl.rl.sampler.errors import SamplerTimeoutError
from asyncrl.rl.tasks.scoring import TaskFailureError
from asyncrl.rl.trainer.errors import PeerRankFailedError, StepDeadlineError


def remote(cls: type, message: str = "what went wrong", actor: str = "a", method: str = "m") -> RemoteError:
    """What the caller raises when ``method`` of ``actor`` raised ``cls`` (as `ActorClient` builds it)."""
    return remote_error_class(cls.__name__, type_path(cls))(actor, method, cls.__name__, message, "Traceback ...")


def test_every_error_of_ours_crosses_as_itself_and_a_remote_error():
    ours = [
        cls
        for path, cls in _KNOWN.items()
        if path.startswith("asyncrl.") and not issubclass(cls, RemoteError) and not cls.__name__.startswith("Remote")
    ]
    assert len(ours) > 40 and CheckpointWriteError in ours and PeerRankFailedError in ours, ours
    for cls in ours:
        error = remote(cls)
        if issubclass(cls, ActorError):  # said of the remote process's own call to some actor
            assert type(error) is RemoteError, cls
            continue
        assert isinstance(error, cls) and isinstance(error, RemoteError), cls
        assert str(error).startswith(f"actor 'a': m() raised {cls.__name__}: what went wrong"), (cls, str(error))
        assert error.remote_message == "what went wrong" and error.remote_traceback == "Traceback ..."
    # the classes' own constructors (a RendezvousTimeoutError's ``missing``...) are not needed
    with pytest.raises(RendezvousError, match="raised RendezvousTimeoutError"):
        raise remote(RendezvousTimeoutError)
    assert isinstance(remote(RendezvousTimeoutError), TimeoutError)


def test_names_the_caller_does_not_know_stay_plain_remote_errors():
    class Local(AsyncrlError):
        __module__ = "users.module"

    assert remote_error_class("Local", type_path(Local)).__bases__ == (RemoteError, Local)  # a user's, once defined
    for name, path in [
        ("CheckpointWriteError", "users.elsewhere.CheckpointWriteError"),  # same name, not ours
        ("ValueError", "users.module.ValueError"),  # a builtin's name in a user's module
        ("Gone", "asyncrl.rl.checkpoint.Gone"),  # under our package, but no such class
        ("system", "os.system"),
        ("Exception", "builtins.Exception"),
        ("", ""),
    ]:
        assert remote_error_class(name, path) is RemoteError, path
    assert issubclass(remote_error_class("KeyError", "builtins.KeyError"), KeyError)
    assert issubclass(remote_error_class("KeyError"), KeyError)  # no path: a builtin by its name only


def test_two_classes_of_one_name_stay_apart():
    def twin(module: str) -> type[AsyncrlError]:
        class Twin(AsyncrlError):
            __module__ = module

        return Twin

    first, second = twin("users.one"), twin("users.two")
    one = remote_error_class("Twin", type_path(first))
    two = remote_error_class("Twin", type_path(second))
    assert issubclass(one, first) and not issubclass(one, second)
    assert issubclass(two, second) and not issubclass(two, first)


def test_the_driver_catches_the_errors_of_ranks_and_samplers_without_torch():
    code = (
        "import sys; import asyncrl.rl.driver.fleet.pool, asyncrl.rl.driver.fleet.trainer_ranks, "
        "asyncrl.rl.driver.grpo; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_peer_failure_is_told_by_its_type():
    assert suffered_from_peer(remote(CollectiveError)) and suffered_from_peer(remote(WeightSyncError))
    assert not suffered_from_peer(CollectiveError("a local one says nothing of a member"))
    fake = RemoteError("sampler1", "receive_weights", "CollectiveError", "a user's class of that name")
    assert not suffered_from_peer(fake) and not suffered_from_peer(remote(SamplerTimeoutError))


def test_a_rank_that_left_for_a_peer_is_not_the_cause():
    ranks = TrainerRanks([SimpleNamespace(name="trainer"), SimpleNamespace(name="trainer-1")])
    left = remote(PeerRankFailedError, "trainer rank 0 left train step 3: trainer rank 1 failed", "trainer")
    cause = remote_error_class("ValueError")("trainer-1", "train_step", "ValueError", "bad batch")
    verdict = ranks._verdict("train_step", [left, cause], stops_the_run=True)
    assert isinstance(verdict, TrainerRankFailedError), verdict
    assert "trainer rank 1 (trainer-1) failed during train_step: ValueError: bad batch; rank(s) 0 left" in str(verdict)
    # only victims: the verdict names one, as the failure, for want of a cause
    verdict = ranks._verdict(
        "train_step", [left, remote(StepDeadlineError, "deadline", "trainer-1")], stops_the_run=True
    )
    assert "trainer rank 0 failed during train_step: PeerRankFailedError" in str(verdict), verdict
    # a user's error that only shares the name is a cause, not a victim
    named = RemoteError("trainer", "train_step", "PeerRankFailedError", "not ours")
    verdict = ranks._verdict(
        "train_step", [named, remote(StepDeadlineError, "deadline", "trainer-1")], stops_the_run=True
    )
    assert "trainer rank 0 (trainer) failed" in str(verdict) and "rank(s) 1 left" in str(verdict), verdict


def test_a_trainer_of_one_rank_is_its_handle_as_it_is():
    # No group, no verdict, no deadline of the group's (deadline_s 0.0, the endpoint's own default):
    # every call is the one handle's own, so a run of one rank sees the errors (and the messages)
    # its trainer's handle gives.
    calls = []

    class Handle(SimpleNamespace):
        def with_timeout(self, timeout_s):
            return Handle(name=self.name, timeout_s=timeout_s)

        def __getattr__(self, method):
            return lambda *args, **kwargs: calls.append((self.timeout_s, method, args, kwargs))

    ranks = TrainerRanks([Handle(name="trainer", timeout_s=None)])
    assert ranks.name == "trainer" and ranks.world_size == 1
    ranks.with_timeout(7.0).train_step(["batch"])
    ranks.sync_listen("host")
    assert calls == [(7.0, "train_step", (["batch"], 0.0), {}), (None, "sync_listen", ("host", 0), {})]


async def test_errors_raised_in_an_actor_are_caught_by_their_type():
    async with Supervisor() as sup:
        actor = await sup.spawn(RaisesOurs, name="raises")
        with pytest.raises(CheckpointWriteError, match="No space left on device") as info:
            await actor.raise_error("checkpoint_write")
        assert isinstance(info.value, RemoteError) and "raise self._error(kind)" in info.value.remote_traceback
        with pytest.raises(TaskFailureError):
            await actor.raise_error("task_failure")
        with pytest.raises(SamplerTimeoutError):
            await actor.raise_error("sampler_timeout")
        with pytest.raises(RendezvousTimeoutError, match=r"rank\(s\) \[2\] did not arrive"):
            await actor.raise_error("rendezvous_timeout")
        # an actor that the endpoint called died: not the death of the actor we called
        with pytest.raises(RemoteError) as info:
            await actor.raise_error("actor_died")
        assert type(info.value) is RemoteError and info.value.remote_type == "ActorDiedError"


async def test_a_trainer_group_verdict_from_real_ranks():
    async with Supervisor() as sup:
        left = await sup.spawn(RaisesOurs, "peer_rank", name="trainer")
        failed = await sup.spawn(RaisesOurs, "runtime", name="trainer-1")
        with pytest.raises(
            TrainerRankFailedError,
            match=r"trainer rank 1 \(trainer-1\) failed during train_step: "
            r"RuntimeError: a bug of this rank; rank\(s\) 0 left",
        ):
            await TrainerRanks([left, failed]).with_timeout(30.0).train_step([])
