"""A TCP proxy on loopback that can add latency: how the chaos suite makes one service slow.

The mesh dials the proxy instead of the service (``MeshConfig.dial_overrides``). While ``delay_s`` is 0
bytes pass straight through; set it and every chunk, in both directions, is held that long before it is
forwarded. Order is kept and throughput is not capped: a slow link, not a narrow one (a gRPC stream
arrives late, then at its usual pace). Connections opened before a change keep flowing and take the new
delay from their next chunk on.

The proxies run on one event loop in a thread of their own, so a busy load generator does not slow them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

CHUNK_BYTES = 64 * 1024


@dataclass
class DelayProxy:
    """Listens on ``port`` and forwards to 127.0.0.1:``upstream``."""

    name: str
    port: int
    upstream: int
    delay_s: float = 0.0

    async def serve(self) -> asyncio.Server:
        return await asyncio.start_server(self._connection, "127.0.0.1", self.port)

    async def _connection(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            client_writer.close()  # the service is down: its clients see a refused connection, as without us
            return
        # Cancelled when the proxies shut down: the pumps closed both sides; end quietly (a cancelled
        # connection task is logged as a failed callback).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(
                self._pump(client_reader, upstream_writer), self._pump(upstream_reader, client_writer)
            )

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copies one direction; each chunk waits out the delay set when it arrived."""
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                due, chunk = await held.get()
                if not chunk:
                    break
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()

        forwarding = asyncio.create_task(forward())
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                held.put_nowait((loop.time() + self.delay_s, chunk))
        except (ConnectionError, OSError):
            pass
        finally:
            held.put_nowait((0.0, b""))
            with contextlib.suppress(ConnectionError, OSError):
                await forwarding
            writer.close()


class DelayProxies:
    """Delay proxies by name, served on an event loop in a background thread until ``close()``."""

    def __init__(self, proxies: list[DelayProxy]) -> None:
        self.by_name = {proxy.name: proxy for proxy in proxies}
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxies", daemon=True)
        self._thread.start()
        for proxy in proxies:
            self._servers.append(asyncio.run_coroutine_threadsafe(proxy.serve(), self._loop).result(10))

    def set_delay(self, name: str, delay_s: float) -> None:
        # A float is read and written whole: no lock needed between the threads.
        self.by_name[name].delay_s = delay_s

    def close(self) -> None:
        """Stops listening, cuts every connection through the proxies and ends their thread."""

        async def shutdown() -> None:
            for server in self._servers:
                server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
