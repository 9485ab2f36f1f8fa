"""A small asyncio web service on Clone: feature flags read per request.

    python scripts/examples/flags_service.py tcp://127.0.0.1:5556 8080

``GET /flags/NAME`` answers the flag's JSON value from the local replica (no
round trip to the servers, nothing to await), with ``X-Clone-Synced`` saying
whether the replica is live; ``PUT /flags/NAME`` with a JSON body sets it and
answers once the active server confirmed it (a following GET sees it).  Written on
asyncio's own streams so that it runs with the standard library alone; the
same service as a FastAPI app is fastapi_service.py.
"""

from __future__ import annotations

import asyncio
import json
import sys

from clone import NotJSON
from clone.aio import AsyncClone


async def handle(c: AsyncClone, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method, path, _ = head[0].split(" ", 2)
        headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
        body = await reader.readexactly(int(headers.get("Content-Length", "0")))
        name = path.removeprefix("/flags/")
        key = f"/flags/{name}"
        if method == "GET":
            entry = c.entry(key)
            fresh = c.freshness()
            value = None if entry is None else json.loads(entry.value or b"null")
            status, payload = 200, {"flag": name, "value": value}
            extra = f"X-Clone-Synced: {'yes' if fresh.synced else 'no'}\r\n"
        elif method == "PUT":
            try:
                sequence = await c.set_json(key, json.loads(body))
                status, payload, extra = 200, {"flag": name, "sequence": sequence}, ""
            except (NotJSON, ValueError) as exc:
                status, payload, extra = 400, {"error": str(exc)}, ""
        else:
            status, payload, extra = 405, {"error": "GET or PUT"}, ""
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
    finally:
        writer.close()


async def serve(servers: str, port: int, ready: asyncio.Event | None = None) -> None:
    async with AsyncClone(servers) as c:
        server = await asyncio.start_server(lambda r, w: handle(c, r, w), "127.0.0.1", port)
        async with server:
            if ready is not None:
                ready.set()
            print(f"serving flags on 127.0.0.1:{port}", flush=True)
            await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
