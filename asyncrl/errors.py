"""Typed errors of the runtime. Each one says who was involved and what was awaited or refused."""

from __future__ import annotations

import builtins

_KNOWN: dict[str, type] = {}
"""Every `AsyncrlError` subclass defined in this process, by `type_path` (filled by
`AsyncrlError.__init_subclass__`)."""
_REMOTE: dict[str, type[RemoteError]] = {}


def type_path(cls: type) -> str:
    """``module.QualName``: how an exception's type is named on the wire (`wire.Failure.type_path`).
    Two classes of one name in different modules stay apart."""
    return f"{cls.__module__}.{cls.__qualname__}"


class AsyncrlError(Exception):
    """Base class of every error asyncrl raises on purpose.

    Every subclass registers itself when it is defined (`__init_subclass__`): raised in an actor's
    endpoint or constructor, it reaches the caller as itself, also a `RemoteError` (see
    `remote_error_class`), so the caller catches it by its type, never by its name as a string."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _KNOWN[type_path(cls)] = cls


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

    Raised in an actor's endpoint or constructor, it reaches the caller as itself (also a
    `RemoteError`)."""


class ActorError(AsyncrlError):
    """An error that concerns one actor, named in ``actor``. It says how the raising process's call
    to that actor went, so it does not cross processes as itself: an `ActorDiedError` raised in an
    endpoint (a peer the endpoint called died) reaches the caller as a plain `RemoteError`, never
    as the death of the actor it called."""

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
    start; or its constructor raised an `ActionableError` (a policy too large for its GPU). One
    line that names what to change."""


class CallTimeoutError(ActorError, TimeoutError):
    """A call got no reply within its deadline; the call was cancelled on the actor."""

    def __init__(self, actor: str, method: str, timeout_s: float):
        super().__init__(actor, f"{method}() got no reply within {timeout_s:g} s")
        self.method = method
        self.timeout_s = timeout_s


class RemoteError(ActorError):
    """An endpoint raised. ``remote_type`` is the remote exception's type name (for messages; never
    match on it) and ``remote_traceback`` its formatted traceback. When the remote type is a
    builtin exception (``ValueError``, ``KeyError``, ...) or one of asyncrl's own errors, the raised
    object is also an instance of that type, so ``except ValueError`` or ``except
    CheckpointWriteError`` works across the process boundary (`remote_error_class`)."""

    def __init__(self, actor: str, method: str, remote_type: str, message: str, remote_traceback: str = ""):
        text = f"{method}() raised {remote_type}: {message}"
        if remote_traceback:
            text += f"\n--- remote traceback ---\n{remote_traceback}"
        # Not `super().__init__`: in a `Remote<Type>` class the next one in line is the remote
        # type's own, whose arguments (a `RendezvousTimeoutError`'s ``missing``...) never came.
        Exception.__init__(self, f"actor {actor!r}: {text}")
        self.actor = actor
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


def remote_error_class(type_name: str, path: str = "") -> type[RemoteError]:
    """The local class that re-raises a remote exception of type ``path`` (``type_name`` alone
    when the sender gave no path).

    A builtin exception class or an `AsyncrlError` subclass defined in this process (its module
    imported) is re-raised as a class that is both `RemoteError` and that type; any other name
    stays a plain `RemoteError`. Nothing is imported, unpickled or evaluated by a name that came
    over the wire: the name is only looked up among the classes already known here. `ActorError`s
    describe the remote process's own call to some actor and stay plain (see `ActorError`); our
    `RemoteError` subclasses (the server's refusals) are themselves."""
    path = path or f"builtins.{type_name}"
    cls = _REMOTE.get(path)
    if cls is not None:
        return cls
    module, _, name = path.rpartition(".")
    base = _KNOWN.get(path) or (getattr(builtins, name, None) if module == "builtins" else None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or base in (Exception, BaseException):
        return RemoteError
    if issubclass(base, RemoteError):
        cls = base
    elif issubclass(base, ActorError):
        return RemoteError
    else:
        try:
            cls = type(
                f"Remote{base.__name__}",
                (RemoteError, base),
                {"__init__": RemoteError.__init__, "__str__": BaseException.__str__, "__module__": base.__module__},
            )
        except TypeError:  # a layout the mix cannot take (a builtin with its own C fields): plain
            return RemoteError
    _REMOTE[path] = cls
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
