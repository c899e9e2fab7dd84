"""Spawns two actors (one with a grandchild), serves the status of RUN_DIR (argv[1]), and blocks
one actor's loop so that a graceful shutdown waits for it. Prints the pids, the supervisor's socket
directory and the status socket as JSON; the blocked actor prints "[held-1]: blocked"; "closing"
follows on stdout when a signal starts the shutdown. Used by test_lifecycle.py to interrupt that
shutdown with a second signal."""

import asyncio
import json
import os
import sys

from actors import Echo
from asyncrl import Supervisor


async def main(run_dir: str):
    async with Supervisor(call_timeout_s=120, stop_timeout_s=60) as sup:
        a, b = await sup.spawn_group(Echo, 2, name="held")
        grandchild = await a.spawn_grandchild()
        pids = [await a.getpid(), await b.getpid(), grandchild]
        server = await sup.serve_status(run_dir)
        blocked = asyncio.ensure_future(b.say_then_block("blocked", 120))  # b's loop cannot read its Shutdown
        print(
            json.dumps(
                {
                    "driver": os.getpid(),
                    "pids": pids,
                    "run_dir": sup._resources.run_dir,
                    "status_address": server.address,
                }
            ),
            flush=True,
        )
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            print("closing", flush=True)
            blocked.cancel()
            raise


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
