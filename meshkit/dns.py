"""Names to addresses for the peers a service keeps one connection each to (a Kubernetes headless
Service resolves to one address per ready pod): the router's engines, the orchestrator's routers."""

from __future__ import annotations

import asyncio
import socket


async def resolve(address: str) -> set[str]:
    """``host:port`` as the ``ip:port`` addresses its host resolves to now (an IP resolves to itself);
    raises OSError when the name does not resolve."""
    host, port = address.rsplit(":", 1)
    infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    return {join(str(info[4][0]), port) for info in infos}


def join(ip: str, port: str) -> str:
    """``ip:port``, with an IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
