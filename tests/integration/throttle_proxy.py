"""A TCP proxy that slows what a server sends back to a set rate: a real store made slow on
purpose (the tests put it in front of the real Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

_PIECE = 4096  # bytes forwarded per write: the rate is kept per piece, not per reply


class ThrottleProxy:
    """Listens on 127.0.0.1:`port`; forwards to `upstream`, replies at most `bytes_per_s`."""

    def __init__(self, upstream: tuple[str, int], bytes_per_s: float) -> None:
        self.upstream = upstream
        self.bytes_per_s = bytes_per_s
        self.port = 0
        self.bytes_sent = 0  # bytes forwarded back to clients
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="throttle-proxy", daemon=True)

    def __enter__(self) -> ThrottleProxy:
        self._thread.start()
        if not self._ready.wait(10) or not self.port:
            raise RuntimeError("the throttling proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            with contextlib.suppress(Exception):
                # one turn of the loop, so the cancelled tasks run their cleanup; no waiting
                self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer, limit=False),
            self._pump(up_reader, writer, limit=True),
            return_exceptions=True,
        )

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, limit: bool
    ) -> None:
        try:
            while data := await src.read(_PIECE):
                dst.write(data)
                await dst.drain()
                if limit:
                    self.bytes_sent += len(data)
                    # the throttling itself, not a synchronization: pace replies at bytes_per_s
                    await asyncio.sleep(len(data) / self.bytes_per_s)
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()


@contextlib.contextmanager
def throttled(upstream: tuple[str, int], bytes_per_s: float) -> Iterator[ThrottleProxy]:
    """A running proxy to `upstream` at `bytes_per_s`; stopped on leaving."""
    with ThrottleProxy(upstream, bytes_per_s) as proxy:
        yield proxy
