"""Node 0 of a test cluster (run with ``asyncrl launch --nnodes N --node-rank 0``): one actor per
node, each with a grandchild; prints their pids as JSON, then waits to be killed."""

import asyncio
import json
import os

from actors import Echo
from asyncrl import Supervisor


async def main():
    async with Supervisor(call_timeout_s=30) as sup:
        n = sup.config.nnodes
        actors = await asyncio.gather(*(sup.spawn(Echo, name=f"on-{r}", node=r) for r in range(n)))
        pids = []
        for a in actors:
            pids += [await a.getpid(), await a.spawn_grandchild()]
        print(json.dumps({"driver": os.getpid(), "pids": pids, "nodes": [s.node for s in sup.status()]}), flush=True)
        await asyncio.sleep(120)
