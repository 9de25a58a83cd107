"""A component's links to every frontend, however many there are.

`--frontend-address` is one address or a comma list, and a tcp:// host name in it may stand
for several frontends: `docker compose --scale frontend=N`, or a headless Kubernetes Service,
whose name resolves to one address per pod. Each frontend gets its own DEALER, connected
when its address appears and closed when it goes (`refresh`), so heartbeats and stats reach
every frontend, and a reply goes back to the frontend that asked on the socket it came from.

    --frontend-address tcp://kvflow-frontend:5557
        resolves to 10.0.0.4, 10.0.0.9  ->  DEALER tcp://10.0.0.4:5557, DEALER tcp://10.0.0.9:5557
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket as net
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from shared.constants import HEARTBEAT_INTERVAL_S, LINKS_REFRESH_S
from shared.ipc import connect_dealer, encode
from shared.protocol import Heartbeat

logger = logging.getLogger(__name__)
Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


def resolve_host(host: str, port: int) -> list[str]:
    infos = net.getaddrinfo(host, port, type=net.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def split_addresses(address: str) -> list[str]:
    return [a.strip() for a in address.split(",") if a.strip()]


class FrontendLinks:
    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        identity: str,
        resolve: Resolver = resolve_host,
    ) -> None:
        self.context, self.identity, self.resolve = context, identity, resolve
        self.addresses = split_addresses(address)
        self.sockets: dict[str, zmq.Socket[Any]] = {}  # endpoint -> its DEALER
        self.refresh()

    def endpoints(self) -> set[str] | None:
        """Every frontend endpoint now; None when a name does not resolve (keep what is)."""
        found: set[str] = set()
        for address in self.addresses:
            host, port = _host_and_port(address)
            if host is None or _is_ip(host):
                found.add(address)
                continue
            try:
                ips = self.resolve(host, port)
            except OSError as exc:
                logger.debug("%s: %s does not resolve yet (%s)", self.identity, host, exc)
                return None
            found.update(f"tcp://{_bracketed(ip)}:{port}" for ip in ips)
        return found

    def refresh(self) -> tuple[list[zmq.Socket[Any]], list[zmq.Socket[Any]]]:
        """Connect new frontends, close gone ones; returns (added, removed) sockets."""
        wanted = self.endpoints()
        if wanted is None:
            return [], []
        added = [self._connect(endpoint) for endpoint in sorted(wanted - self.sockets.keys())]
        removed = [self.sockets.pop(e) for e in sorted(self.sockets.keys() - wanted)]
        for socket in removed:
            socket.close()
        if added or removed:
            logger.info("%s: frontends %s", self.identity, ", ".join(sorted(self.sockets)))
        return added, removed

    def _connect(self, endpoint: str) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = connect_dealer(self.context, endpoint, self.identity)
        self.sockets[endpoint] = socket
        return socket

    def send_all(self, data: bytes) -> None:
        """To every frontend, never blocking: one not reading (its queue full) misses it."""
        for socket in self.sockets.values():
            with contextlib.suppress(zmq.Again):
                socket.send(data, flags=zmq.DONTWAIT)

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close()
        self.sockets.clear()


def start_heartbeat(
    address: str, component: str, draining: threading.Event | None = None
) -> threading.Event:
    """Tell every frontend this process is alive, from a daemon thread; set the event to
    stop. Each beat also says whether `draining` is set."""
    stop = threading.Event()
    session = os.urandom(8).hex()

    def beat() -> None:
        links = FrontendLinks(zmq.Context.instance(), address, f"{component}-heartbeat")
        refreshed = time.monotonic()
        while True:
            if time.monotonic() - refreshed > LINKS_REFRESH_S:
                links.refresh()
                refreshed = time.monotonic()
            beat_msg = Heartbeat(
                component=component,
                pid=os.getpid(),
                sent_at=time.time(),
                session=session,
                draining=draining is not None and draining.is_set(),
            )
            links.send_all(encode(beat_msg))
            if stop.wait(HEARTBEAT_INTERVAL_S):
                break
        links.close()

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return stop


def _host_and_port(address: str) -> tuple[str | None, int]:
    """The host and port of a tcp:// address; (None, 0) for any other transport."""
    if not address.startswith("tcp://"):
        return None, 0
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host == "*"
    return True


def _bracketed(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
