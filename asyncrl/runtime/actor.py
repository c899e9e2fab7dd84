"""``Actor`` and ``@endpoint``: what a user writes to make a class callable from other processes.

An endpoint's parameter and return annotations are its wire types. Arguments are bound to the
signature by the caller (defaults applied there), sent as one msgpack array, and decoded by the
actor against ``tuple[annotation, ...]``, so a wrong type is refused with the parameter's name
before user code runs. Unannotated parameters accept anything msgspec can carry.
"""

from __future__ import annotations

import collections.abc
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from types import GenericAlias
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast, overload

import msgspec

from asyncrl.runtime.codec import PayloadDecoder

_ENDPOINT_ATTR = "__asyncrl_endpoint__"
RESERVED_NAMES = frozenset({"info", "kill", "name", "pinned", "wait_for_incarnation", "wait_for_state", "with_timeout"})
"""Attributes of an ``ActorHandle``; an endpoint may not be named like one of them."""
S = TypeVar("S")
P = ParamSpec("P")
R = TypeVar("R")
_STREAM_ORIGINS = (
    collections.abc.AsyncIterator,
    collections.abc.AsyncGenerator,
    collections.abc.AsyncIterable,
)


class Endpoint(Generic[S, P, R]):
    """A method marked `endpoint`, as the type checker sees it: on an instance, the method itself
    (``Callable[P, R]``, ``self`` bound); on the class, this. At run time it is the plain function:
    nothing here runs. ``S`` is the actor class, ``P`` the parameters after ``self``, ``R`` what
    the method returns; the typing plugin reads ``P`` and ``R`` for the caller's view through an
    ``ActorHandle`` (``typing_plugin.py``)."""

    @overload
    def __get__(self, obj: None, owner: type[S]) -> Endpoint[S, P, R]: ...
    @overload
    def __get__(self, obj: S, owner: type[S] | None = None) -> Callable[P, R]: ...
    def __get__(self, obj: S | None, owner: type[S] | None = None) -> Endpoint[S, P, R] | Callable[P, R]:
        raise NotImplementedError("a type-checking view only: an endpoint is its function")


def endpoint(fn: Callable[Concatenate[S, P], R]) -> Endpoint[S, P, R]:
    """Mark a method of an ``Actor`` subclass as callable through an ``ActorHandle``; the method
    itself is returned, typed as an `Endpoint` of its signature (what the typing plugin reads).

    ``async def`` endpoints run as tasks on the actor's event loop, so several can be in flight
    at once; a plain ``def`` runs on the loop and blocks it until it returns; an ``async def``
    containing ``yield`` is a stream, consumed with ``async for``."""
    if not callable(fn):
        raise TypeError("@endpoint decorates a method")
    setattr(fn, _ENDPOINT_ATTR, True)
    return cast(Endpoint[S, P, R], fn)  # the function is its own descriptor; Endpoint is its type


class Actor:
    """Base class of actors. Subclass it, mark methods with ``@endpoint``, and spawn it with
    ``Supervisor.spawn``. ``__init__`` runs in the actor's own process with the decoded spawn
    arguments; ``on_start``/``on_stop`` are optional async hooks run after construction and at a
    graceful stop."""

    async def on_start(self) -> None:
        """Runs once on the actor's loop after ``__init__``, before any call is accepted."""

    async def on_stop(self) -> None:
        """Runs once when the supervisor stops the actor gracefully."""


@dataclass
class EndpointSpec:
    name: str
    signature: inspect.Signature
    params: list[str]
    arg_types: list[Any]
    return_type: Any
    is_async: bool
    is_stream: bool
    n_positional: int = 0
    _arg_decoder: PayloadDecoder | None = field(default=None, repr=False)
    _return_decoder: PayloadDecoder | None = field(default=None, repr=False)

    def bind(self, args: tuple, kwargs: dict) -> list:
        """Caller side: the positional argument list, defaults filled, or ``TypeError``."""
        if not kwargs and len(args) == len(self.params) and self.n_positional == len(args):
            return list(args)  # the common case, without inspect's binding machinery
        try:
            bound = self.signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}(): {e}") from None
        bound.apply_defaults()
        return [bound.arguments[p] for p in self.params]

    def invoke(self, target: Callable, args: tuple) -> Any:
        """Actor side: call ``target`` (a bound method) with decoded ``args``."""
        n = self.n_positional
        if n == len(args):
            return target(*args)
        return target(*args[:n], **dict(zip(self.params[n:], args[n:])))

    @property
    def arg_decoder(self) -> PayloadDecoder:
        if self._arg_decoder is None:
            self._arg_decoder = PayloadDecoder(
                GenericAlias(tuple, tuple(self.arg_types)) if self.arg_types else tuple[()]
            )
        return self._arg_decoder

    @property
    def return_decoder(self) -> PayloadDecoder:
        if self._return_decoder is None:
            self._return_decoder = PayloadDecoder(self.return_type)
        return self._return_decoder

    def explain(self, error: msgspec.ValidationError) -> str:
        """Rewrite msgspec's ``$[i]`` path into the parameter's name."""
        text = str(error)
        m = re.search(r"`\$\[(\d+)\]", text)
        if m and int(m.group(1)) < len(self.params):
            path = "$[" + m.group(1) + "]"
            text = text.replace(path, self.params[int(m.group(1))])
        return f"{self.name}(): {text}"


def _hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception as e:  # an annotation that cannot be resolved is the author's bug: say where
        raise TypeError(f"endpoint {fn.__qualname__}: cannot resolve its annotations ({e})") from e


def _stream_item_type(annotation: Any) -> Any:
    if typing.get_origin(annotation) in _STREAM_ORIGINS:
        args = typing.get_args(annotation)
        return args[0] if args else Any
    return Any


def build_spec(fn: Callable) -> EndpointSpec:
    sig = inspect.signature(fn)
    hints = _hints(fn)
    params, types, n_positional = [], [], 0
    for i, (pname, p) in enumerate(sig.parameters.items()):
        if i == 0:
            continue  # self
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(
                f"endpoint {fn.__qualname__}: *args/**kwargs cannot be typed on the wire; name each parameter"
            )
        if p.kind is not p.KEYWORD_ONLY:
            n_positional += 1
        params.append(pname)
        types.append(hints.get(pname, Any))
    if inspect.isgeneratorfunction(fn):
        raise TypeError(f"endpoint {fn.__qualname__}: a stream must be an `async def` generator")
    is_stream = inspect.isasyncgenfunction(fn)
    ret = hints.get("return", Any)
    return EndpointSpec(
        name=fn.__name__,
        signature=sig,
        params=params,
        arg_types=types,
        return_type=_stream_item_type(ret) if is_stream else (Any if ret is type(None) else ret),
        is_async=inspect.iscoroutinefunction(fn) or is_stream,
        is_stream=is_stream,
        n_positional=n_positional,
    )


_SPECS: dict[type, dict[str, EndpointSpec]] = {}


def endpoints_of(cls: type) -> dict[str, EndpointSpec]:
    """The endpoints of an actor class, by name (cached)."""
    specs = _SPECS.get(cls)
    if specs is None:
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"{cls!r} is not a subclass of asyncrl.Actor")
        specs = {}
        for name in dir(cls):
            fn = getattr(cls, name, None)
            if callable(fn) and getattr(fn, _ENDPOINT_ATTR, False):
                if name in RESERVED_NAMES or name.startswith("_"):
                    raise TypeError(
                        f"{cls.__qualname__}.{name}: endpoint names may not start with '_' or be one "
                        f"of {sorted(RESERVED_NAMES)}"
                    )
                specs[name] = build_spec(fn)
        _SPECS[cls] = specs
    return specs


def init_spec(cls: type) -> EndpointSpec:
    """The constructor, treated like an endpoint so spawn arguments are typed the same way."""
    init = cls.__init__  # type: ignore[misc]  # cls is the class here, not an instance of it
    if init is object.__init__:
        return EndpointSpec(
            "__init__",
            inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]),
            [],
            [],
            Any,
            False,
            False,
        )
    spec = build_spec(init)
    spec.name = f"{cls.__qualname__}.__init__"
    return spec
