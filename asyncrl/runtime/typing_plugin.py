"""A mypy plugin that types an actor's handle by its class: ``ActorHandle[Squarer]().square`` is
the endpoint ``Squarer.square`` as its caller sees it. Enable it in mypy's configuration::

    [tool.mypy]
    plugins = ["asyncrl.runtime.typing_plugin"]

What it checks, for a handle whose actor class is known (``Supervisor.spawn(cls)`` returns
``ActorHandle[cls]``):

* an attribute that is not an ``@endpoint`` of the class (a typo, a helper method) is an error;
* an endpoint is a `RemoteMethod` over the method's own parameters (``self`` bound), so every
  call's arguments are checked, and its result is what awaiting the call gives: the method's
  return for ``async def`` and plain ``def`` endpoints alike (a plain one runs in the actor, but
  its caller awaits it too), and for a stream the method's own async iterator;
* ``h.with_timeout(t)`` and ``h.pinned(i)`` keep the class.

A handle of unknown class (``ActorHandle`` bare, or ``ActorHandle[Any]``) stays as loose as before:
its attributes are ``RemoteMethod[..., Any]``. At run time nothing here is imported: the handle is
the same dynamic proxy, with or without the plugin (vLLM's clients declare each call by hand; here
the actor class is the declaration, and the checker reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from mypy.nodes import Decorator, Var
from mypy.plugin import AttributeContext, Plugin
from mypy.types import AnyType, Instance, Parameters, Type, TypeOfAny, get_proper_type

HANDLE = "asyncrl.runtime.handle.ActorHandle"
ENDPOINT = "asyncrl.runtime.actor.Endpoint"
"""The type `@endpoint` gives a method: ``Endpoint[S, P, R]``, kept in mypy's cache (a decorator's
own expression is not, so the mark is read from the type)."""
AWAITED_AS_IS = frozenset({"typing.Coroutine", "typing.AsyncIterator", "typing.AsyncGenerator", "typing.AsyncIterable"})
"""What a method returns when its caller takes the result as it is: an ``async def``'s coroutine,
a stream's async iterator. Anything else comes from a plain ``def``, whose call is awaited too."""


class ActorHandlePlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        # Called for every attribute read of an ActorHandle: it defines __getattr__.
        owner, _, name = fullname.rpartition(".")
        return partial(remote_method_type, name) if owner == HANDLE else None


def remote_method_type(name: str, ctx: AttributeContext) -> Type:
    """The type of ``handle.<name>``: see the module docstring."""
    handle = ctx.type
    if not isinstance(handle, Instance) or handle.type.get(name) is not None or not handle.args:
        return ctx.default_attr_type  # the handle's own attributes (name, info, ...)
    actor = get_proper_type(handle.args[0])
    remote = get_proper_type(ctx.default_attr_type)  # RemoteMethod[..., Any], from __getattr__
    if not isinstance(actor, Instance) or not isinstance(remote, Instance):
        return ctx.default_attr_type  # a handle of unknown class
    marked = _endpoint_type(actor, name)
    if marked is None:
        ctx.api.fail(f'Actor "{actor.type.name}" has no endpoint "{name}"', ctx.context)
        return AnyType(TypeOfAny.from_error)
    _, parameters, result = marked.args
    returned = get_proper_type(result)
    if not (isinstance(returned, Instance) and returned.type.fullname in AWAITED_AS_IS):
        anything = AnyType(TypeOfAny.special_form)
        result = ctx.api.named_generic_type("typing.Coroutine", [anything, anything, result])
    if not isinstance(get_proper_type(parameters), Parameters):
        return ctx.default_attr_type
    return Instance(remote.type, [parameters, result])


def _endpoint_type(actor: Instance, name: str) -> Instance | None:
    """``Endpoint[S, P, R]`` of the actor class's method ``name`` (its own or inherited), or None
    where ``name`` is no endpoint of it."""
    symbol = actor.type.get(name)
    node = symbol.node if symbol is not None else None
    var = node.var if isinstance(node, Decorator) else node
    typ = get_proper_type(var.type) if isinstance(var, Var) else None
    if isinstance(typ, Instance) and typ.type.fullname == ENDPOINT and len(typ.args) == 3:
        return typ
    return None


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return ActorHandlePlugin
