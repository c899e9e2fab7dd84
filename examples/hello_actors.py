"""A first look at the runtime: two actors, typed calls, a stream, a tensor, and a crash.

asyncrl launch examples/hello_actors.py
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import torch

from asyncrl import Actor, ActorDiedError, Supervisor, endpoint


class Squarer(Actor):
    def __init__(self, scale: float = 1.0):
        self.scale = scale

    @endpoint
    async def square(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x * x

    @endpoint
    async def countdown(self, n: int) -> AsyncIterator[int]:
        for i in range(n, 0, -1):
            yield i

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def nap(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def main() -> None:
    async with Supervisor() as sup:
        a, b = await sup.spawn_group(Squarer, 2, 0.5, name="squarer", max_restarts=1)
        print("square:", (await a.square(torch.arange(4.0))).tolist())
        print("countdown:", [i async for i in b.countdown(5)])
        pid = await b.pid()
        napping = asyncio.ensure_future(b.nap(60))
        await asyncio.sleep(0.2)
        os.kill(pid, 9)  # a crash while a call is pending: the call fails at once
        try:
            await napping
        except ActorDiedError as e:
            print("as expected:", e)
        print("after restart:", (await b.square(torch.ones(2))).tolist(), b.info().restarts, "restart(s)")


if __name__ == "__main__":
    import asyncrl

    asyncrl.run(main())
