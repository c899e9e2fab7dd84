"""The driver's HTTP endpoint for production (``--run.metrics_port N``): Prometheus ``/metrics``
and a deep ``/healthz``.

``/metrics``: the latest value of every metric of metrics.jsonl and of the run's progress as
gauges (``asyncrl_reward_mean``, ``asyncrl_progress_dropped_stale``, ...) and one
``asyncrl_actor_up{actor=...}`` per actor, in the exposition format of prometheus-client (the
maintained library; its encoder also answers OpenMetrics to a scraper that asks for it).

``/healthz``: what an orchestrator's liveness probe needs. It asks the supervisor for every
actor's state and calls a trivial endpoint of every running actor (the driver names which)
under ``--run.health_timeout_s``; 200 with a JSON body when all answer, else 503 naming each dead
or silent actor, or the driver as ``stalled`` with the reason while the run makes no step
(rl/observe/stall.py). Each request is answered on the driver's event loop, so a driver whose loop is
stuck is found too (its answer does not come within the deadline: 503).

The HTTP server is the standard library's, in daemon threads; it binds ``--run.metrics_host``
(127.0.0.1 by default). `close()` shuts it down and frees the port. It has no authentication, so
it changes nothing: ``POST /scale`` is refused with 403 and a line naming ``asyncrl scale``, which
asks over the run's owner-only status socket (docs/elastic.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, TypeVar

from asyncrl.errors import ActorDiedError, first_line
from asyncrl.rl.config.observe import ObserveConfig
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.observe.stall import StallWatch
from asyncrl.runtime.state import ActorState
from asyncrl.runtime.supervisor import Supervisor
from asyncrl.runtime.timeouts import timeout

T = TypeVar("T")

Probe = Callable[[], Awaitable[object]]


class ObservedRun(Protocol):
    """What the endpoint asks of a running run (the driver, `GRPODriver`, answers it): the
    endpoint is handed it, and imports nothing of the driver."""

    stall: StallWatch

    def probes(self, timeout_s: float) -> dict[str, Probe]:
        """A trivial call per actor, each bounded by ``timeout_s``."""
        ...

    def snapshot(self) -> dict[str, float]:
        """The numbers of the last step's record and of the progress."""
        ...


OK_STATES = (ActorState.RUNNING, ActorState.STARTING)
"""Actor states that are healthy so far: a starting actor is given its start deadline."""


class MetricsEndpoint:
    """``/metrics`` and ``/healthz`` on ``host:port`` (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        statuses: Callable[[], list[Any]],
        probes: Callable[[], dict[str, Probe]],
        snapshot: Callable[[], dict[str, float]],
        timeout_s: float,
        loop: asyncio.AbstractEventLoop,
        stalled: Callable[[], str] = lambda: "",
    ):
        self.statuses, self.probes, self.snapshot, self.stalled = statuses, probes, snapshot, stalled
        self.timeout_s, self.loop = timeout_s, loop
        try:
            self.server = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as exc:
            raise ConfigError(f"--run.metrics_port {port}: cannot listen on {host}:{port}: {exc.strerror}") from None
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        thread = threading.Thread(target=self.server.serve_forever, name="asyncrl-metrics-http", daemon=True)
        self.thread: threading.Thread | None = thread
        thread.start()

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self.thread is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5.0)
            self.thread = None

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, report): every actor's state, and the answer of each running one's probe.
        A dead actor reads ``"dead: <why>"`` whether the supervisor or the probe found it first."""
        running = {s.name for s in self.statuses() if s.state is ActorState.RUNNING}
        probes = {name: probe for name, probe in self.probes().items() if name in running}
        results = await asyncio.gather(*(self._bounded(p) for p in probes.values()), return_exceptions=True)
        statuses = self.statuses()  # again: an actor may have died while it was probed
        unhealthy = {
            s.name: f"{s.state}: {s.error}" if s.error else str(s.state) for s in statuses if s.state not in OK_STATES
        }
        for name, result in zip(probes, results):
            if name in unhealthy or not isinstance(result, BaseException):
                continue
            if isinstance(result, ActorDiedError):
                unhealthy[name] = f"dead: {result.reason}"
            elif isinstance(result, (asyncio.TimeoutError, TimeoutError)):  # CallTimeoutError too
                unhealthy[name] = f"silent: no answer within {self.timeout_s:g} s"
            else:
                unhealthy[name] = f"{type(result).__name__}: {first_line(result)}"
        stalled = self.stalled()  # every actor may answer while the run makes no step (rl/observe/stall.py)
        if stalled:
            unhealthy["driver"] = f"stalled: {stalled}"
        return not unhealthy, {
            "healthy": not unhealthy,
            "unhealthy": unhealthy,
            "actors": {s.name: str(s.state) for s in statuses},
            **({"stalled": stalled} if stalled else {}),
        }

    async def _bounded(self, probe: Probe) -> Any:
        async with timeout(self.timeout_s):
            return await probe()

    def on_loop(self, coro: Coroutine[object, object, T]) -> T:
        """Run ``coro`` on the driver's loop and wait for it from an HTTP thread (bounded)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.timeout_s + 1.0)
        except TimeoutError:
            future.cancel()
            raise


def exposition(snapshot: dict[str, float], actors: list[Any], accept: str) -> tuple[bytes, str]:
    """``snapshot`` and the actors' states in the format the scraper accepts (prometheus-client)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.exposition import choose_encoder

    class Snapshot:  # a collector of one request's values (a registry per request: no shared state)
        def collect(self):
            for key, value in sorted(snapshot.items()):
                family = GaugeMetricFamily(metric_name(key), f"latest {key} of the run")
                family.add_metric([], value)
                yield family
            up = GaugeMetricFamily("asyncrl_actor_up", "1 if the actor is running", labels=["actor", "state"])
            for s in actors:
                up.add_metric([s.name, str(s.state)], 1.0 if s.state is ActorState.RUNNING else 0.0)
            yield up

    registry = CollectorRegistry()
    registry.register(Snapshot())
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def metric_name(key: str) -> str:
    """A metrics.jsonl key as a Prometheus name: ``task/solved`` -> ``asyncrl_task_solved``."""
    return "asyncrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _handler(endpoint: MetricsEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":

                    async def snap():
                        return endpoint.snapshot(), endpoint.statuses()

                    snapshot, actors = endpoint.on_loop(snap())
                    body, content_type = exposition(snapshot, actors, self.headers.get("Accept", ""))
                    self._send(200, body, content_type)
                elif path == "/healthz":
                    healthy, report = endpoint.on_loop(endpoint.health())
                    self._send(200 if healthy else 503, json.dumps(report).encode(), "application/json")
                else:
                    self._send(404, b"not found: try /metrics or /healthz\n", "text/plain")
            except TimeoutError:
                report = {
                    "healthy": False,
                    "unhealthy": {"driver": f"its event loop did not answer within {endpoint.timeout_s + 1:g} s"},
                }
                self._send(503, json.dumps(report).encode(), "application/json")
            except RuntimeError as exc:  # the loop is closed: the run is ending
                self._send(
                    503,
                    json.dumps({"healthy": False, "unhealthy": {"driver": first_line(exc)}}).encode(),
                    "application/json",
                )

        def do_POST(self) -> None:  # noqa: N802
            # This endpoint has no authentication (a scraper reads it), so it changes nothing:
            # scaling is asked over the run's owner-only status socket instead.
            if self.path.split("?", 1)[0] == "/scale":
                self._send(
                    403,
                    b"refused: this endpoint is unauthenticated and read-only; scale the run with "
                    b"`asyncrl scale RUN_DIR --samplers N` on the driver's host\n",
                    "text/plain",
                )
            else:
                self._send(404, b"not found: this endpoint serves GET /metrics and /healthz\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # a scraper every 15 s would flood the console
            pass

    return Handler


def open_endpoint(
    observe: ObserveConfig,
    sup: Supervisor,
    driver: Callable[[], ObservedRun | None],
    log: Callable[[str], None] = print,
) -> MetricsEndpoint | None:
    """The endpoint ``observe`` (the run's `ObserveConfig`) asks for, serving what ``driver()``
    (the `GRPODriver`, or None while the run starts) knows; None with ``metrics_port`` 0."""
    if not observe.metrics_port:
        return None

    def probes() -> dict[str, Probe]:
        d = driver()
        return d.probes(observe.health_timeout_s) if d is not None else {}

    def snapshot() -> dict[str, float]:
        d = driver()
        return d.snapshot() if d is not None else {}

    def stalled() -> str:
        d = driver()
        return d.stall.reason if d is not None else ""

    endpoint = MetricsEndpoint(
        observe.metrics_host,
        observe.metrics_port,
        statuses=sup.status,
        probes=probes,
        snapshot=snapshot,
        timeout_s=observe.health_timeout_s,
        loop=asyncio.get_running_loop(),
        stalled=stalled,
    )
    log(f"metrics endpoint: http://{observe.metrics_host}:{endpoint.port}/metrics and /healthz")
    return endpoint
