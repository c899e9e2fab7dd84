"""Typed errors of the runtime. Each one says who was involved and what was awaited or refused."""

from __future__ import annotations

import builtins


class AsyncrlError(Exception):
    """Base class of every error asyncrl raises on purpose."""


class UsageError(AsyncrlError):
    """What the user asked for (a flag, a path, a setting) cannot be done; the message says what
    would be accepted. ``asyncrl launch`` prints it as one line and exits with status 2, no
    traceback: the fix is in the command line, not in the code."""


class ActionableError(AsyncrlError):
    """An error the user fixes with a setting or the machine, not in the code: its first line says
    what happened and what to change (a start that overran its deadline, memory that ran out, a
    checkpoint that does not fit). ``asyncrl launch`` prints that line on stderr and exits with
    status 1, no traceback; a GRPO run keeps the traceback in RUN_DIR/log.txt. Other errors keep
    their traceback: they are bugs.

    A subclass raised in an actor's endpoint reaches the caller as itself (also a `RemoteError`)
    once it is registered with `crosses_processes`."""


class ActorError(AsyncrlError):
    """An error that concerns one actor, named in ``actor``."""

    def __init__(self, actor: str, message: str):
        super().__init__(f"actor {actor!r}: {message}")
        self.actor = actor


class ActorDiedError(ActorError):
    """The actor's process exited or stopped answering while a call was pending, or before it."""

    def __init__(self, actor: str, reason: str):
        super().__init__(actor, f"died ({reason})")
        self.reason = reason


class ActorStartError(ActorError):
    """The actor's process could not be started, or its constructor raised (traceback attached)."""

    def __init__(self, actor: str, message: str, remote_traceback: str = ""):
        text = message if not remote_traceback else f"{message}\n--- remote traceback ---\n{remote_traceback}"
        super().__init__(actor, text)
        self.remote_traceback = remote_traceback


class ActorNotReadyError(ActorStartError, ActionableError):
    """The actor's process did not become ready: it overran its start deadline (``start_timeout_s``
    or the budget of the start phase it reported), its heartbeats stopped, or it exited during its
    start; or its constructor raised an `ActionableError` registered with `crosses_processes` (a
    policy too large for its GPU). One line that names what to change."""


class CallTimeoutError(ActorError, TimeoutError):
    """A call got no reply within its deadline; the call was cancelled on the actor."""

    def __init__(self, actor: str, method: str, timeout_s: float):
        super().__init__(actor, f"{method}() got no reply within {timeout_s:g} s")
        self.method = method
        self.timeout_s = timeout_s


class RemoteError(ActorError):
    """An endpoint raised. ``remote_type`` is the remote exception's type name and
    ``remote_traceback`` its formatted traceback. When the remote type is a builtin exception
    (``ValueError``, ``KeyError``, ...), the raised object is also an instance of that type, so
    ``except ValueError`` works across the process boundary."""

    def __init__(self, actor: str, method: str, remote_type: str, message: str, remote_traceback: str = ""):
        text = f"{method}() raised {remote_type}: {message}"
        if remote_traceback:
            text += f"\n--- remote traceback ---\n{remote_traceback}"
        ActorError.__init__(self, actor, text)
        self.method = method
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback


class InvalidArgumentsError(RemoteError, TypeError):
    """The actor refused a call whose arguments do not match the endpoint's annotations."""


class UnknownMethodError(RemoteError, AttributeError):
    """The actor has no endpoint of that name."""


class MessageTooLargeError(AsyncrlError, ValueError):
    """A message is larger than the configured ``max_message_bytes``."""


class ProtocolError(AsyncrlError):
    """A frame could not be decoded (garbage, truncated, or of the wrong type)."""


class NoFreeDevicesError(AsyncrlError):
    """A spawn asked for more accelerator devices than are free."""


class ClusterStartError(AsyncrlError):
    """Not every node agent joined the cluster within ``join_timeout_s``; ``missing`` lists
    the node ranks that did not."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


class SupervisorClosedError(AsyncrlError):
    """The supervisor is not running (not entered yet, or already closed)."""


_BY_NAME: dict[str, type[RemoteError]] = {
    "InvalidArgumentsError": InvalidArgumentsError,
    "UnknownMethodError": UnknownMethodError,
}
_BUILTIN_MIXINS: dict[str, type[RemoteError]] = {}


_CROSSING: dict[str, type[RemoteError]] = {}


def crosses_processes(cls: type[AsyncrlError]) -> type[AsyncrlError]:
    """Class decorator: an endpoint that raises ``cls`` fails its caller with an error that is an
    instance of ``cls`` too (and of `RemoteError`), so the caller catches it by its type, never by
    its name as a string. The class must be imported in the caller's process (the module that
    defines it registers it); a name that is not registered stays a plain `RemoteError`."""
    if not (isinstance(cls, type) and issubclass(cls, AsyncrlError)) or issubclass(cls, RemoteError):
        raise TypeError(f"crosses_processes takes an AsyncrlError subclass that is not a RemoteError, not {cls!r}")
    name = cls.__name__
    known = _CROSSING.get(name)
    if known is not None and cls not in known.__mro__:
        raise TypeError(f"two error classes named {name!r} cross processes: {known.__mro__[2]!r} and {cls!r}")
    _CROSSING[name] = type(f"Remote{name}", (RemoteError, cls), {
        "__init__": RemoteError.__init__, "__str__": BaseException.__str__, "__module__": cls.__module__})
    return cls


def remote_error_class(type_name: str) -> type[RemoteError]:
    """The local class that re-raises a remote exception of ``type_name``.

    Only our own remote error types, those registered with `crosses_processes`, and exception
    classes of ``builtins`` are mapped; nothing is ever imported by a name that came over the wire."""
    if type_name in _BY_NAME:
        return _BY_NAME[type_name]
    if type_name in _CROSSING:
        return _CROSSING[type_name]
    cls = _BUILTIN_MIXINS.get(type_name)
    if cls is None:
        base = getattr(builtins, type_name, None)
        if not (isinstance(base, type) and issubclass(base, Exception)) or base in (
            Exception,
            BaseException,
        ):
            return RemoteError
        try:
            cls = type(f"Remote{type_name}", (RemoteError, base), {"__init__": RemoteError.__init__, "__str__": BaseException.__str__})
        except TypeError:  # layout conflict (e.g. OSError subclasses): plain RemoteError
            return RemoteError
        _BUILTIN_MIXINS[type_name] = cls
    return cls


def first_line(exc: BaseException | str) -> str:
    """The first line of an error's message (at most 300 characters), or its type's name when it
    has none: what a one-line report of it shows."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else "" if isinstance(exc, str) else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """An error as `asyncrl launch` reports one the user fixes: its whole first line (a remote
    traceback, which follows it, is left out), or its type's name when it has no message."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
