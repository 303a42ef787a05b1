"""F1's floor: what uvicorn itself spends per streamed SSE event, with nothing of corectl in the path.

    python benchmarks/asgi_floor.py [--streams 256] [--events 128] [--tick-ms 16] [--app asgi|litestar]

A server process runs uvicorn (uvloop and httptools, as `corectl serve` does) with an app that
holds `--streams` SSE responses open; every `--tick-ms` one ticker wakes every stream, and each
sends one pre-encoded completions chunk of F1's size (`asgi`: a bare ASGI callable awaiting a
future per event, the least any asyncio server does per event; `litestar`: a Litestar route
returning `Stream` over an async generator that awaits the same future, the framework's own
layers added). Client processes read the streams; the server's utime + stime over the pass
(/proc), divided by the events sent, is the floor F1's per-token figure stands on: an API process
at one event per token cannot spend less per token than this on the same host.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time

FRAME = (b'data: {"id":"cmpl-8c0b6a","object":"text_completion","created":1764300000,"model":"qwen3-0.6b",'
         b'"choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"


class Ticker:
    """Wakes every waiting stream once a tick: one engine step's delivery, without the engine."""

    def __init__(self, tick_s: float):
        self.tick_s = tick_s
        self.waiters: list[asyncio.Future] = []

    def wait(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiters.append(future)
        return future

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            waiters, self.waiters = self.waiters, []
            for future in waiters:
                future.set_result(None)


def asgi_app(ticker: Ticker, events: int):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(events):
            await ticker.wait()
            await send({"type": "http.response.body", "body": FRAME, "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    return app


def litestar_app(ticker: Ticker, events: int):
    from litestar import Litestar, get
    from litestar.response import Stream

    async def frames():
        for _ in range(events):
            await ticker.wait()
            yield FRAME
        yield DONE

    @get("/")
    async def stream() -> Stream:
        return Stream(frames(), media_type="text/event-stream")

    return Litestar([stream], signature_namespace={"Stream": Stream})


def serve(port: int, app_name: str, events: int, tick_s: float, ready) -> None:
    import uvicorn
    import uvloop

    async def main():
        ticker = Ticker(tick_s)
        app = asgi_app(ticker, events) if app_name == "asgi" else litestar_app(ticker, events)
        server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error", loop="uvloop", http="httptools",
                                               lifespan="on"))
        asyncio.get_running_loop().create_task(ticker.run())
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, ready.set)
        await server.serve()

    uvloop.run(main())


def read_streams(port: int, streams: int, counts) -> None:
    import httpx

    async def one(client) -> int:
        seen = 0
        async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
            async for chunk in response.aiter_raw():
                seen += chunk.count(b"data: ")
        return seen

    async def main():
        limits = httpx.Limits(max_connections=streams)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            return sum(await asyncio.gather(*(one(client) for _ in range(streams))))

    counts.put(asyncio.run(main()))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--events", type=int, default=128, help="SSE events a stream")
    parser.add_argument("--tick-ms", type=float, default=16.0, help="time between two events of a stream")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--app", choices=["asgi", "litestar"], default="asgi")
    parser.add_argument("--port", type=int, default=8791)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    ready, counts = ctx.Event(), ctx.Queue()
    server = ctx.Process(target=serve, args=(args.port, args.app, args.events, args.tick_ms / 1e3, ready))
    server.start()
    if not ready.wait(60) or not server.is_alive():
        raise SystemExit("the server did not start")
    clients = [ctx.Process(target=read_streams, args=(args.port, n, counts))
               for n in (args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients))]
    start_cpu, start = cpu_seconds(server.pid), time.monotonic()
    for client in clients:
        client.start()
    events = sum(counts.get() for _ in clients)
    cpu, wall = cpu_seconds(server.pid) - start_cpu, time.monotonic() - start
    for client in clients:
        client.join()
    server.terminate()
    server.join()
    print(f"{args.app}: {args.streams} streams x {args.events} events every {args.tick_ms:g} ms: {events} events "
          f"in {wall:.1f} s ({events / wall:,.0f}/s), server CPU {cpu:.2f} s: {cpu / events * 1e6:.1f} us an event, "
          f"{cpu / wall:.2f} cores")


if __name__ == "__main__":
    main()
