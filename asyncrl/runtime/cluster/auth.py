"""Who may talk to us over TCP: holders of the cluster secret, proven by ZeroMQ CURVE.

Every process of a cluster derives one CURVE key pair from the shared secret (BLAKE2b of the
secret, personalised, is the Curve25519 secret key). Servers use that pair as their server key;
clients use it as their client key and expect it as the server's key. The CURVE handshake then
proves possession in both directions without the secret, or anything derived from it that would
let a listener impersonate us, crossing the wire: a client that lacks the secret cannot decrypt
the server's cookie or sign its vouch, and a fake server cannot answer a client's HELLO. Every
message after the handshake is encrypted and authenticated.

CURVE alone admits any client that knows the server's public key. So each server socket also
consults a ZAP handler (the ``Gatekeeper`` thread), whose allow-list is the single cluster public
key, and sets ``ZAP_ENFORCE_DOMAIN`` so that without a handler nobody is admitted at all. Failed
handshakes (wrong secret, no secret, wrong key) are seen on a socket monitor: counted in
``Gatekeeper.rejected`` and logged (rate-limited, so a flood cannot flood the log).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import secrets
import stat
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

ENV_SECRET = "ASYNCRL_CLUSTER_SECRET"
ENV_SECRET_FILE = "ASYNCRL_CLUSTER_SECRET_FILE"
MIN_SECRET_CHARS = 32
ZAP_DOMAIN = b"asyncrl"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification, one per context
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_LOGGED_IN_FULL = 5
_SUMMARY_EVERY_S = 10.0

log = logging.getLogger("asyncrl.auth")


def new_secret() -> str:
    """A fresh cluster secret: 256 random bits as hex."""
    return secrets.token_hex(32)


def _checked(text: str, origin: str) -> str:
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret from {origin} is {len(text)} characters; use at least {MIN_SECRET_CHARS}")
    return text


def load_secret(environ=os.environ) -> str | None:
    """The secret from ``ASYNCRL_CLUSTER_SECRET``, else from the file named by
    ``ASYNCRL_CLUSTER_SECRET_FILE`` (which must not be readable by group or others), else None."""
    text = environ.get(ENV_SECRET)
    if text:
        return _checked(text, ENV_SECRET)
    path = environ.get(ENV_SECRET_FILE)
    if not path:
        return None
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the cluster secret file {path!r} ({ENV_SECRET_FILE}): {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"the cluster secret file {path!r} is accessible by group or others; chmod 600 it")
    return _checked(text, path)


def write_secret(path: str) -> None:
    """Create ``path`` (mode 0600, refusing to overwrite) holding a new secret."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(new_secret() + "\n")


@dataclass(frozen=True)
class ClusterKeys:
    """The CURVE key pair every holder of ``secret`` derives alike."""

    secret: str
    public_key: bytes
    secret_key: bytes

    @classmethod
    def from_secret(cls, secret: str) -> ClusterKeys:
        raw = hashlib.blake2b(secret.encode(), digest_size=32, person=b"asyncrl-curve-1").digest()
        secret_key = z85.encode(raw)
        return cls(secret, zmq.curve_public(secret_key), secret_key)

    def secure_client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.public_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key

    def __repr__(self) -> str:  # never print the secret
        return f"ClusterKeys(public_key={self.public_key!r})"


def keys_from_env(environ=os.environ) -> ClusterKeys | None:
    secret = load_secret(environ)
    return ClusterKeys.from_secret(secret) if secret else None


class Gatekeeper:
    """The ZAP handler and handshake-failure monitor of one ZeroMQ context, on a thread of its
    own, so admission never waits for a busy event loop. Create it before binding any server
    socket of that context; ``close()`` it before terminating the context."""

    def __init__(self, ctx: zmq.Context, keys: ClusterKeys, name: str):
        self.keys = keys
        self.name = name
        self.rejected = 0
        """Connections refused so far (failed handshakes and allow-list denials)."""
        self._ctx = ctx
        self._allowed = z85.decode(keys.public_key)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._logged = 0
        self._last_summary = 0.0
        self._unlogged = 0
        self._thread = threading.Thread(target=self._run, name="asyncrl-gatekeeper", daemon=True)
        self._thread.start()
        if not self._started.wait(10.0) or self._error is not None:
            self.close()
            raise OSError(f"{name}: the ZAP handler did not start: {self._error or 'timed out after 10 s'}")

    def secure_server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server admitting only cluster members, with its
        refusals counted. Returns once the monitor is listening."""
        sock.curve_server = True
        sock.curve_publickey = self.keys.public_key
        sock.curve_secretkey = self.keys.secret_key
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        endpoint = f"inproc://asyncrl-monitor-{id(sock):x}-{secrets.token_hex(4)}"
        sock.monitor(endpoint, _REFUSED)
        attached = threading.Event()
        self._requests.put((endpoint, attached))
        if not attached.wait(10.0):
            raise OSError(f"{self.name}: the gatekeeper did not attach its monitor within 10 s")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    # --- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        monitors: list[zmq.Socket] = []
        try:
            zap = self._ctx.socket(zmq.ROUTER)
            zap.linger = 0
            zap.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            self._started.set()
            return
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        self._started.set()
        try:
            while not self._stop.is_set():
                while not self._requests.empty():
                    endpoint, attached = self._requests.get()
                    mon = self._ctx.socket(zmq.PAIR)
                    mon.linger = 0
                    mon.connect(endpoint)
                    monitors.append(mon)
                    poller.register(mon, zmq.POLLIN)
                    attached.set()
                # the timeout only bounds how late a stop or a new monitor is noticed
                for sock, _ in poller.poll(100):
                    if sock is zap:
                        self._answer(zap)
                    else:
                        self._on_event(sock.recv_multipart())
        finally:
            for s in (zap, *monitors):
                s.close(0)

    def _answer(self, zap: zmq.Socket) -> None:
        frames = zap.recv_multipart()
        # [envelope, b"", version, request id, domain, address, identity, mechanism, *credentials]
        if len(frames) < 8 or frames[1] != b"":
            return
        version, request_id, domain, address, _, mechanism, *credentials = frames[2:]
        admitted = (
            version == b"1.0"
            and domain == ZAP_DOMAIN
            and mechanism == b"CURVE"
            and len(credentials) == 1
            and secrets.compare_digest(credentials[0], self._allowed)
        )
        status, text = (b"200", b"OK") if admitted else (b"400", b"not a member of this cluster")
        zap.send_multipart([frames[0], b"", b"1.0", request_id, status, text, b"", b""])
        if not admitted:  # the monitor counts it (EVENT_HANDSHAKE_FAILED_AUTH); say who it was
            self._note(f"refused {address.decode(errors='replace')}: its CURVE key is not the cluster's")

    def _on_event(self, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)
        except Exception:
            return
        if event["event"] & _REFUSED:
            self.rejected += 1
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._note(
                    f"refused a peer at {event['endpoint'].decode(errors='replace')}: handshake failed "
                    f"(code {event['value']:#x}; no or wrong cluster secret?)"
                )

    def _note(self, text: str) -> None:
        self._logged += 1
        if self._logged <= _LOGGED_IN_FULL:
            log.warning("%s: %s", self.name, text)
            return
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_summary >= _SUMMARY_EVERY_S:
            log.warning(
                "%s: %d more connection(s) refused (latest: %s); %d refused in all",
                self.name,
                self._unlogged,
                text,
                self.rejected,
            )
            self._unlogged, self._last_summary = 0, now
