"""Spawns two actors (one with a grandchild), prints their pids and the run directory as JSON,
then waits to be killed or interrupted. Used by test_lifecycle.py, directly and via asyncrl launch."""

import asyncio
import json
import os
import sys

from actors import Echo
from asyncrl import Supervisor


async def main():
    async with Supervisor(call_timeout_s=30) as sup:
        a, b = await sup.spawn_group(Echo, 2, name="held")
        grandchild = await a.spawn_grandchild()
        pids = [await a.getpid(), await b.getpid(), grandchild]
        print(json.dumps({"driver": os.getpid(), "pids": pids, "run_dir": sup._resources.run_dir}), flush=True)
        await asyncio.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 60)


if __name__ == "__main__":
    asyncio.run(main())
