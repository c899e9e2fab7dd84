import asyncio

from actors import Echo
from asyncrl import Supervisor


class Local(Echo):
    """Defined in the launched script itself: actor processes load this file to find it."""


async def amain():
    async with Supervisor() as sup:
        local = await sup.spawn(Local, 5)
        print("no-main script got", await local.add(1), __name__, flush=True)


if __name__ == "__main__":
    asyncio.run(amain())
