"""A TCP proxy on loopback that delays every byte by a fixed time in each direction.

    python bench/delay_proxy.py --target 127.0.0.1:6379 --delay-ms 2

Prints the port it listens on (one line), then forwards until killed. Each chunk read from one
side is written to the other ``delay`` after it was read, in order, so a request/reply round trip
costs ``2 x delay`` more — what ``tc netem delay`` on the loopback interface does, without slowing
every other process on the machine. Runs in its own process so it never competes with the
benchmark for the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

CHUNK_BYTES = 65536


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy reader to writer, each chunk held until ``delay_s`` after it arrived (order kept)."""
    pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await pending.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    delivering = asyncio.create_task(deliver())
    try:
        while data := await reader.read(CHUNK_BYTES):
            pending.put_nowait((time.monotonic() + delay_s, data))
    except OSError:
        pass
    pending.put_nowait((0.0, b""))
    with contextlib.suppress(OSError):
        await delivering


async def serve(target_host: str, target_port: int, delay_s: float) -> None:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            pump(client_reader, upstream_writer, delay_s),
            pump(upstream_reader, client_writer, delay_s),
        )

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:6379")
    parser.add_argument("--delay-ms", type=float, default=2.0)
    args = parser.parse_args()
    host, _, port = args.target.rpartition(":")
    asyncio.run(serve(host, int(port), args.delay_ms / 1000))


if __name__ == "__main__":
    main()
