from actors import Echo
from asyncrl import Supervisor


async def main():
    async with Supervisor() as sup:
        echo = await sup.spawn(Echo, 1)
        print("async main got", await echo.add(1), flush=True)
