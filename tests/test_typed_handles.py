"""A handle typed by its actor's class (asyncrl/runtime/typing_plugin.py), checked the way a user's
project checks it: mypy with the plugin over a script that spawns an actor and calls it, rightly
and wrongly. Each wrong call must be an error naming what is wrong; each right one, its type."""

from __future__ import annotations

import os

import pytest

import asyncrl

api = pytest.importorskip("mypy.api")

ROOT = os.path.dirname(os.path.dirname(asyncrl.__file__))

SCRIPT = """
from __future__ import annotations

from collections.abc import AsyncIterator

from asyncrl import Actor, ActorHandle, Supervisor, endpoint


class Squarer(Actor):
    @endpoint
    async def square(self, x: int, *, scale: float = 1.0) -> float:
        return x * x * scale

    @endpoint
    def version(self) -> str:
        return "1"

    @endpoint
    async def count(self, n: int) -> AsyncIterator[int]:
        yield n

    def helper(self) -> None: ...


async def main(sup: Supervisor) -> None:
    h = await sup.spawn(Squarer)
    reveal_type(h)  # line 26
    reveal_type(await h.square(3))
    reveal_type(await h.with_timeout(2).pinned(1).version())
    async for i in h.count(2):
        reveal_type(i)
    await h.square("3")  # line 31
    await h.square(3, scale="x")
    h.helper()
    h.sqare
    loose: ActorHandle = h
    reveal_type(loose.anything)  # line 36
    reveal_type(h.square.with_timeout(1.0))
"""


def _check(tmp_path) -> list[str]:
    (tmp_path / "script.py").write_text(SCRIPT.lstrip("\n"))
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nplugins = asyncrl.runtime.typing_plugin\nfollow_imports = silent\n"
        f"mypy_path = {ROOT}\npython_version = 3.10\n"
    )
    config, cache = str(tmp_path / "mypy.ini"), str(tmp_path / "cache")
    out, err, _ = api.run(["--config-file", config, "--cache-dir", cache, str(tmp_path / "script.py")])
    assert not err, err
    return [line.split("script.py:", 1)[1] for line in out.splitlines() if "script.py:" in line]


def test_a_handle_carries_its_actors_endpoint_signatures(tmp_path):
    lines = _check(tmp_path)
    assert lines == [
        '26: note: Revealed type is "asyncrl.runtime.handle.ActorHandle[script.Squarer]"',
        '27: note: Revealed type is "float"',
        '28: note: Revealed type is "str"',  # a plain `def` endpoint is awaited too
        '30: note: Revealed type is "int"',  # a stream's items
        '31: error: Argument 1 to "__call__" of "RemoteMethod" has incompatible type "str"; expected "int"  [arg-type]',
        '32: error: Argument "scale" to "__call__" of "RemoteMethod" has incompatible type "str"; '
        'expected "float"  [arg-type]',
        '33: error: Actor "Squarer" has no endpoint "helper"  [misc]',
        '34: error: Actor "Squarer" has no endpoint "sqare"  [misc]',
        '36: note: Revealed type is "asyncrl.runtime.handle.RemoteMethod[..., Any]"',  # unknown class: loose
        '37: note: Revealed type is "asyncrl.runtime.handle.RemoteMethod[[x: int, *, scale: '
        'float =], typing.Coroutine[Any, Any, float]]"',
    ]
