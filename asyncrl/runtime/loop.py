"""One way to run an event loop everywhere in asyncrl: uvloop when it is importable."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(coro)``, on uvloop when it is installed (actor processes use it too)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
