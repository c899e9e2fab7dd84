"""Which weight version sampled which tokens of each request a vLLM engine runs for one client.

`VLLMBackend` numbers its requests in the order it sends them (`RequestVersions.begin`) and, at
each weight load, is told where the engine's requests stood then (`RequestVersions.changed`): a
table by vLLM's internal request id (`compat.request_positions`), and the number its next request
would have taken when the load was asked for. A client of a shared engine (``shared.py``) is told
after its host loaded, with the table the engine kept from that load.

The rule, for each sample of each request still running here:

* listed: every token before its position was sampled with the old weights, every later one with
  the new (exact);
* not listed, and sent after the load was asked for: it reached the engine after the load, so it
  begins with the new weights (the engine takes a client's requests and calls in the order sent);
* not listed, and sent before: it had not begun, or had already ended (its outputs not yet read
  here; a client learns of a load after it). Its tokens keep the old version: its lag is
  over-counted, never hidden.
"""

from __future__ import annotations

import re

from asyncrl.rl.generation import VersionSpan

_INTERNAL_ID = re.compile(r"^(?:(\d+)_)?(asyncrl-[0-9a-f]{8}-\d+)(?:-.*)?$")
"""vLLM's internal id of one of our requests: ours (``asyncrl-<client>-<number>``), a sample's
``"{index}_"`` before it where the request has several (vLLM's parallel sampling), and a random
suffix after it in the vLLM releases that make external ids unique."""


class RequestVersions:
    """The version spans of the requests one client has running, by request id."""

    def __init__(self) -> None:
        self._running: dict[str, tuple[int, list[list[VersionSpan]]]] = {}  # id -> (number, per sample)
        self._unplaced = False  # warned once: the engine could not say where requests stood at a load

    def begin(self, request_id: str, number: int, samples: int, version: int) -> list[list[VersionSpan]]:
        """Request ``request_id``, the ``number``-th sent, of ``samples`` samples, begins under
        ``version``: its spans, per sample (kept up to date until `end`)."""
        spans = [[VersionSpan(0, version)] for _ in range(samples)]
        self._running[request_id] = (number, spans)
        return spans

    def end(self, request_id: str) -> None:
        del self._running[request_id]

    def changed(self, version: int, positions: dict[str, int] | None, since: int) -> None:
        """The engine loaded ``version``; ``positions``: where its requests stood then, by vLLM's
        internal id (None where it could not tell: every running request keeps the old version
        for the rest of its tokens); ``since``: the number of the first request sent after the
        load was asked for. See the module docstring for the rule."""
        if positions is None:
            if self._running and not self._unplaced:
                self._unplaced = True
                print(
                    "VLLMBackend: the engine did not say where its requests stood at a weight update: their "
                    "later tokens are counted as of the older version",
                    flush=True,
                )
            return
        stood = _by_sample(positions)
        for request_id, (number, samples) in self._running.items():
            for index, spans in enumerate(samples):
                at = stood.get((request_id, index))
                if at is None:
                    if number < since:
                        continue
                    at = 0
                if at <= spans[-1].start:
                    spans[-1] = VersionSpan(spans[-1].start, version)  # no token of the old span yet
                else:
                    spans.append(VersionSpan(at, version))


def _by_sample(positions: dict[str, int]) -> dict[tuple[str, int], int]:
    """``positions`` by (our request id, sample index); ids not ours are left out."""
    out = {}
    for internal, count in positions.items():
        match = _INTERNAL_ID.match(internal)
        if match is not None:
            out[(match.group(2), int(match.group(1) or 0))] = count
    return out
