"""The control-plane wire schema: every message any asyncrl socket carries, as msgspec Structs.

A message travels as ZeroMQ frames ``[body, buffer_1, buffer_2, ...]``: ``body`` is one of the
Structs below encoded as msgpack; large tensors and arrays inside a payload travel as the extra
frames, referenced by index (see ``codec.py``). Payload fields are ``msgspec.Raw``: they are
encoded and decoded a second time against the endpoint's own annotations, so the envelope is
decoded by one fixed, typed decoder per socket and nothing is ever unpickled.

Three conversations use these messages:

* caller <-> actor (DEALER -> the actor's ROUTER): ``ToActor`` requests, ``FromActor`` replies;
* worker <-> supervisor (the worker's DEALERs -> the supervisor's ROUTER): ``ToSupervisor`` up,
  ``ToWorker`` down;
* node agent <-> supervisor (the agent's DEALER -> the supervisor's cluster ROUTER, which also
  carries the ``ToSupervisor`` messages of workers on other nodes): ``FromNode`` up, ``ToAgent``
  down. See ``cluster/nodes.py`` and ``cluster/agent.py``.
"""

from __future__ import annotations

import msgspec
from msgspec import Raw

_OPTS = dict(array_like=True, omit_defaults=True, gc=False, frozen=True)


class _Msg(msgspec.Struct, tag_field="t", **_OPTS):
    pass


# --- caller -> actor -------------------------------------------------------------------------


class Call(_Msg, tag=1):
    """Run endpoint ``method`` with positional ``args`` (a msgpack array). ``id`` is unique per
    caller connection; the actor answers with ``Reply``/``Failure`` (or ``StreamItem``s and a
    ``StreamEnd`` for a streaming endpoint) carrying the same ``id``."""

    id: int
    method: str
    args: Raw


class Cancel(_Msg, tag=2):
    """The caller gave up on call ``id`` (timeout, cancellation, or a stream it stopped reading)."""

    id: int


class StreamCredit(_Msg, tag=3):
    """The caller consumed ``n`` more items of stream ``id``: the actor may send ``n`` more.
    This credit window is what bounds a stream's buffering on both sides."""

    id: int
    n: int


# --- actor -> caller -------------------------------------------------------------------------


class Reply(_Msg, tag=4):
    id: int
    value: Raw


class StreamItem(_Msg, tag=5):
    id: int
    value: Raw


class StreamEnd(_Msg, tag=6):
    id: int


class Failure(_Msg, tag=7):
    """Call ``id`` failed. ``id`` is 0 when the request could not even be decoded."""

    id: int
    type_name: str
    message: str
    traceback: str = ""
    type_path: str = ""
    """``module.QualName`` of the exception (`asyncrl.errors.type_path`): the caller re-raises it as
    that type when it knows the class (`remote_error_class`); never imported by it."""


# --- worker -> supervisor --------------------------------------------------------------------


class Hello(_Msg, tag=10):
    """First message of a new worker process: it asks for its ``Init``."""

    actor: str
    incarnation: int
    pid: int


class Ready(_Msg, tag=11):
    """The constructor returned; calls are accepted at ``address``."""

    actor: str
    incarnation: int
    address: str


class StartFailed(_Msg, tag=12):
    actor: str
    incarnation: int
    type_name: str
    message: str
    traceback: str = ""
    type_path: str = ""  # as in `Failure`


class Heartbeat(_Msg, tag=13):
    actor: str
    incarnation: int


class StartPhase(_Msg, tag=15):
    """A starting actor names what it is doing (``asyncrl.runtime.start_phase``): the supervisor's
    start deadline becomes now + max(start_timeout_s, ``budget_s``). ``knob`` is the setting that
    raises ``budget_s`` (named when the phase overruns it); "" when there is none. Sent from the
    heartbeat thread, so a constructor that holds the event loop still gets it out."""

    actor: str
    incarnation: int
    phase: str
    budget_s: float = 0.0
    knob: str = ""


class Dead(_Msg, tag=14):
    """Last words of a worker that is exiting (sent with linger), so the supervisor can say why."""

    actor: str
    incarnation: int
    reason: str


# --- supervisor -> worker --------------------------------------------------------------------


class Init(_Msg, tag=20):
    """Which class to build and with what. ``module`` is imported by name, or, when ``script`` is
    set, the file at that path is loaded (classes defined in a launched script)."""

    module: str
    qualname: str
    script: str
    args: Raw
    sys_path: list[str]
    bind_address: str
    max_message_bytes: int
    heartbeat_interval_s: float


class Shutdown(_Msg, tag=21):
    """Stop serving, run ``on_stop``, and exit."""

    reason: str


# --- node agent -> supervisor ----------------------------------------------------------------

NODE_PROTOCOL = 2
"""Bumped whenever a node message changes; an agent of another version is refused at join."""


class NodeHello(_Msg, tag=30):
    """An agent asks to join as node ``rank``. ``agent_id`` is random per agent process, so a
    retried hello is recognised and a second agent claiming the same rank is not."""

    protocol: int
    rank: int
    nnodes: int
    agent_id: str
    hostname: str
    address: str
    pid: int
    device_kind: str
    devices: list[str]
    cores: int = 0
    """The CPU cores the agent's processes may run on (its affinity); 0 from an agent older than
    this field (a trailing default: either side may be the older one)."""


class NodeHeartbeat(_Msg, tag=31):
    rank: int
    agent_id: str


class ActorStarted(_Msg, tag=32):
    actor: str
    incarnation: int
    pid: int


class ActorExited(_Msg, tag=33):
    """The actor's process on this node is gone (or never started); ``reason`` says how."""

    actor: str
    incarnation: int
    reason: str


class ActorLog(_Msg, tag=34):
    """Lines an actor wrote, without their newlines; ``stream`` is 1 (stdout) or 2 (stderr)."""

    actor: str
    incarnation: int
    stream: int
    lines: list[str]


class NodeDraining(_Msg, tag=36):
    """An agent of an elastic cluster told to stop: its node is leaving. It starts no new actor and
    waits up to ``timeout_s`` for the ones it runs to be stopped by their owner (the GRPO driver
    drains its samplers there first), then stops the rest and says `NodeLeaving`."""

    rank: int
    agent_id: str
    reason: str
    timeout_s: float


class NodeLeaving(_Msg, tag=35):
    """Last words of an agent that is stopping (its actors are already stopped)."""

    rank: int
    agent_id: str
    reason: str


# --- supervisor -> node agent ----------------------------------------------------------------


class NodeWelcome(_Msg, tag=40):
    heartbeat_interval_s: float
    node_timeout_s: float
    zygote_preload: str = ""
    """The supervisor's ``zygote_preload``: the agent forks its actors from a zygote of its own
    that imports these modules, where it may (no accelerator, ``ASYNCRL_ZYGOTE`` not 0 on its node);
    "": every actor by ``Popen``. A trailing default: an older agent leaves it, and starts by ``Popen``."""


class NodeRejected(_Msg, tag=41):
    reason: str


class SpawnActor(_Msg, tag=42):
    """Start a worker process for ``actor``. ``env`` is the user's (it overrides the agent's
    environment, device visibility included); the agent adds the runtime's own variables."""

    actor: str
    incarnation: int
    devices: list[str]
    env: dict[str, str]
    supervisor_address: str
    init_timeout_s: float


class StopActor(_Msg, tag=43):
    """SIGTERM the actor's process group, then SIGKILL after ``term_timeout_s``."""

    actor: str
    incarnation: int
    term_timeout_s: float


class KillActor(_Msg, tag=44):
    actor: str
    incarnation: int


class NodeShutdown(_Msg, tag=45):
    """Stop every actor of this node and exit."""

    reason: str


ToActor = Call | Cancel | StreamCredit
FromActor = Reply | StreamItem | StreamEnd | Failure
ToSupervisor = Hello | Ready | StartFailed | Heartbeat | StartPhase | Dead
ToWorker = Init | Shutdown
FromNode = (
    Hello
    | Ready
    | StartFailed
    | Heartbeat
    | StartPhase
    | Dead
    | NodeHello
    | NodeHeartbeat
    | ActorStarted
    | ActorExited
    | ActorLog
    | NodeLeaving
    | NodeDraining
)
ToAgent = NodeWelcome | NodeRejected | SpawnActor | StopActor | KillActor | NodeShutdown
