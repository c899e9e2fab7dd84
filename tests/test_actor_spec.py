"""Endpoint specs: what an actor class may declare, and how arguments are bound."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from asyncrl import Actor, endpoint
from asyncrl.runtime.actor import RESERVED_NAMES, endpoints_of, init_spec


class Good(Actor):
    def __init__(self, a: int, *, b: str = "x"):
        pass

    @endpoint
    async def plain(self, x: int, y: float = 2.0, *, z: str = "z") -> float:
        return x

    @endpoint
    async def stream(self, n: int) -> AsyncIterator[int]:
        yield n

    @endpoint
    async def gen(self) -> AsyncGenerator[str, None]:
        yield "s"

    @endpoint
    def blocking(self, x) -> None:
        pass

    async def not_an_endpoint(self) -> None:
        pass


def test_specs_describe_the_endpoints():
    specs = endpoints_of(Good)
    assert set(specs) == {"plain", "stream", "gen", "blocking"}
    assert specs["plain"].params == ["x", "y", "z"] and specs["plain"].n_positional == 2
    assert specs["plain"].bind((1,), {}) == [1, 2.0, "z"]
    assert specs["plain"].bind((1, 3.0), {"z": "q"}) == [1, 3.0, "q"]
    assert specs["stream"].is_stream and specs["stream"].return_type is int
    assert specs["gen"].is_stream and specs["gen"].return_type is str
    assert not specs["blocking"].is_async
    assert init_spec(Good).bind((1,), {"b": "y"}) == [1, "y"]
    with pytest.raises(TypeError, match="plain"):
        specs["plain"].bind((1, 2.0, "too many"), {})


def test_invoke_passes_keyword_only_parameters_by_name():
    seen = {}

    class Probe(Actor):
        @endpoint
        def f(self, a: int, *, b: int = 0) -> None:
            seen.update(a=a, b=b)

    spec = endpoints_of(Probe)["f"]
    spec.invoke(Probe().f, tuple(spec.bind((1,), {"b": 5})))
    assert seen == {"a": 1, "b": 5}


@pytest.mark.parametrize(
    "body, match",
    [
        ("@endpoint\n    async def f(self, *args): pass", r"\*args"),
        ("@endpoint\n    async def f(self, **kw): pass", r"\*args"),
        ("@endpoint\n    def f(self):\n        yield 1", "async def"),
        ("@endpoint\n    async def name(self): pass", "endpoint names"),
        ("@endpoint\n    async def _private(self): pass", "endpoint names"),
        ("@endpoint\n    async def f(self, x: NoSuchType): pass", "cannot resolve"),
    ],
)
def test_bad_declarations_are_refused_with_the_reason(body, match):
    namespace: dict = {"Actor": Actor, "endpoint": endpoint}
    exec(f"class Bad(Actor):\n    {body}\n", namespace)  # test-local source, not from a process boundary
    with pytest.raises(TypeError, match=match):
        endpoints_of(namespace["Bad"])


def test_every_attribute_of_a_handle_is_a_reserved_name():
    from asyncrl.runtime.handle import ActorHandle  # an endpoint named like one would be shadowed

    assert RESERVED_NAMES == {a for a in dir(ActorHandle) if not a.startswith("_")}


def test_non_actor_classes_are_refused():
    with pytest.raises(TypeError, match="not a subclass"):
        endpoints_of(dict)
