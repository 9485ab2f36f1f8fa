"""A FastAPI service on Clone: feature flags read per request, with ``clone.aio``.

    python scripts/examples/fastapi_service.py tcp://127.0.0.1:5556 8080
    # or: CLONE_SERVERS=tcp://127.0.0.1:5556 FLAGS_ADDRESS=10.0.0.7:8080 \\
    #     uvicorn --app-dir scripts/examples --factory fastapi_service:app_from_env --port 8080

What it shows, with no executor and no bridge written by hand:

* the lifespan opens an :class:`~clone.aio.AsyncClone` (waiting for the first
  sync) and registers the service under ``/services/flags/`` with a lease
  (:class:`clone.aio.Registration`: the key goes when the process dies or
  stops, and comes back after a lost lease); leaving revokes it and closes the
  client;
* ``GET /flags/NAME`` reads the flag from the local replica with ``c.get()``:
  a plain call, nothing awaited, no round trip.  ``X-Clone-Synced`` says
  whether the replica is live and ``X-Clone-Read-Ns`` what the read cost on
  the loop (docs/benchmarks.md);
* ``PUT /flags/NAME`` with a JSON body awaits the active server's
  confirmation (``await c.set_json(...)``), so the next GET sees the flip;
* ``GET /events/flags`` streams every flag change as server-sent events, from
  ``async for change in c.changes("/flags/")``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import StreamingResponse

from clone import NotJSON
from clone.aio import AsyncClone, Registration

FLAGS = "/flags/"


def create_app(servers: str, *, node: str = "node-1", address: str = "127.0.0.1:8080") -> FastAPI:
    """The app for the Clone pair at ``servers``; registered as ``node`` at ``address``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncClone(servers) as c:
            async with Registration(c, f"/services/flags/{node}", address, ttl=5.0) as reg:
                app.state.clone, app.state.registration = c, reg
                yield

    app = FastAPI(title="flags", lifespan=lifespan)

    def clone(request: Request) -> AsyncClone:
        c: AsyncClone = request.app.state.clone
        return c

    @app.get("/flags/{name}")
    async def get_flag(name: str, request: Request, response: Response) -> dict[str, object]:
        c = clone(request)
        started = time.perf_counter_ns()
        raw = c.get(FLAGS + name)  # the local replica: no await, no round trip
        read_ns = time.perf_counter_ns() - started
        response.headers["X-Clone-Synced"] = "yes" if c.freshness().synced else "no"
        response.headers["X-Clone-Read-Ns"] = str(read_ns)
        value = None if raw is None else json.loads(raw)
        return {"flag": name, "value": value}

    @app.put("/flags/{name}")
    async def put_flag(name: str, request: Request) -> dict[str, object]:
        body = await request.body()
        try:
            sequence = await clone(request).set_json(FLAGS + name, json.loads(body))
        except (NotJSON, ValueError) as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return {"flag": name, "sequence": sequence}

    @app.get("/events/flags")
    async def flag_events(request: Request) -> StreamingResponse:
        stream = clone(request).changes(FLAGS)  # subscribed from here on

        async def events() -> AsyncIterator[str]:
            async with stream:
                yield ": subscribed\n\n"
                async for change in stream:
                    data = {"key": change.key, "sequence": change.sequence}
                    data["value"] = json.loads(change.value) if change.value else None
                    yield f"event: flag\ndata: {json.dumps(data)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/services")
    async def services(request: Request) -> dict[str, str]:
        items = await clone(request).items("/services/flags/")
        return {key: value.decode() for key, value in items}

    return app


def app_from_env() -> FastAPI:
    """For ``uvicorn --factory``: the servers from ``CLONE_SERVERS``; the
    address registered from ``FLAGS_ADDRESS`` (uvicorn does not tell the app
    its port), the node's name from ``FLAGS_NODE``."""
    return create_app(
        os.environ["CLONE_SERVERS"],
        node=os.environ.get("FLAGS_NODE", "node-1"),
        address=os.environ.get("FLAGS_ADDRESS", "127.0.0.1:8080"),
    )


if __name__ == "__main__":
    import uvicorn

    port = int(sys.argv[2])
    uvicorn.run(create_app(sys.argv[1], address=f"127.0.0.1:{port}"), host="127.0.0.1", port=port)
