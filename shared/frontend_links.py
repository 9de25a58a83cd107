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

from shared.constants import HEARTBEAT_INTERVAL_S, LINKS_REFRESH_S, MISSING_GRACE_S
from shared.ipc import connect_dealer, encode
from shared.protocol import Heartbeat
from shared.stall_watch import StallWatch
from shared.wire_security import LOCAL, WireSecurity

logger = logging.getLogger(__name__)
Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


def resolve_host(host: str, port: int) -> list[str]:
    infos = net.getaddrinfo(host, port, type=net.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def split_addresses(address: str) -> list[str]:
    return [a.strip() for a in address.split(",") if a.strip()]


class FrontendLinks:
    """`refresh()` never blocks: names are looked up every `lookup_every` seconds on a thread
    of its own (a DNS stall must not stall a loop), and a frontend leaves only after it has
    been missing from the answers for `missing_grace` seconds (one short answer must not cut
    its streams)."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        identity: str,
        resolve: Resolver = resolve_host,
        lookup_every: float | None = LINKS_REFRESH_S,
        missing_grace: float = MISSING_GRACE_S,
        security: WireSecurity = LOCAL,
    ) -> None:
        self.context, self.identity, self.resolve = context, identity, resolve
        self.security = security
        self.addresses = split_addresses(address)
        self.missing_grace = missing_grace
        self.sockets: dict[str, zmq.Socket[Any]] = {}  # endpoint -> its DEALER
        self._found: frozenset[str] | None = None  # the last complete answer
        self._applied: frozenset[str] | None = None  # the answer the sockets follow
        self._missing_since: dict[str, float] = {}
        self._unresolved_since: float | None = None
        self.lookup()
        self.refresh()
        needs_dns = any(_needs_lookup(a) for a in self.addresses)
        if lookup_every is not None and needs_dns:
            threading.Thread(
                target=self._lookup_forever,
                args=(lookup_every,),
                name="frontend-lookup",
                daemon=True,
            ).start()

    def lookup(self) -> None:
        """Resolve every address now (blocking); a name that fails keeps the last answer."""
        found: set[str] = set()
        for address in self.addresses:
            if not _needs_lookup(address):
                found.add(address)
                continue
            host, port = _host_and_port(address)
            try:
                ips = self.resolve(host, port)
            except OSError as exc:
                self._unresolved(host, exc)
                return
            found.update(f"tcp://{_bracketed(ip)}:{port}" for ip in ips)
        self._unresolved_since = None
        self._found = frozenset(found)

    def _unresolved(self, host: str, exc: OSError) -> None:
        now = time.monotonic()
        if self._unresolved_since is None:
            self._unresolved_since = now
        elif now - self._unresolved_since > MISSING_GRACE_S:
            logger.warning(
                "%s: %s has not resolved for %.0f s (%s)",
                self.identity,
                host,
                now - self._unresolved_since,
                exc,
            )
            self._unresolved_since = now  # say it again in as long, not every second

    def _lookup_forever(self, every: float) -> None:
        while True:
            time.sleep(every)
            try:
                self.lookup()
            except Exception:  # the thread must outlive one bad answer
                logger.exception("%s: looking up the frontends failed", self.identity)

    def refresh(self) -> tuple[list[zmq.Socket[Any]], list[zmq.Socket[Any]]]:
        """Connect new frontends, close those gone for the grace; returns (added, removed)."""
        wanted, now = self._found, time.monotonic()
        if wanted is None or (wanted is self._applied and not self._missing_since):
            return [], []  # nothing new since the last call: cheap enough for every loop turn
        self._applied = wanted
        added = [self._connect(e) for e in sorted(wanted - self.sockets.keys())]
        for endpoint in wanted:
            self._missing_since.pop(endpoint, None)
        gone = []
        for endpoint in sorted(self.sockets.keys() - wanted):
            since = self._missing_since.setdefault(endpoint, now)
            if now - since >= self.missing_grace:
                gone.append(endpoint)
                del self._missing_since[endpoint]
        removed = [self.sockets.pop(e) for e in gone]
        for socket in removed:
            socket.close()
        if added or removed:
            logger.info("%s: frontends %s", self.identity, ", ".join(sorted(self.sockets)))
        return added, removed

    def _connect(self, endpoint: str) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = connect_dealer(
            self.context, endpoint, self.identity, self.security
        )
        self.sockets[endpoint] = socket
        return socket

    def send_all(self, data: bytes) -> None:
        """To every frontend, never blocking: one not reading (its queue full) misses it."""
        for socket in self.sockets.values():
            with contextlib.suppress(zmq.Again):
                socket.send(data, flags=zmq.DONTWAIT)

    def close(self, linger_ms: int = 0) -> None:
        for socket in self.sockets.values():
            socket.close(linger=linger_ms)
        self.sockets.clear()


class HeartbeatThread:
    """Tells every frontend this process is alive, a few times a second, from a daemon thread;
    each beat also says whether `draining` is set, and whether the main loop is stuck (then
    `stall_watch` ends the process)."""

    def __init__(
        self,
        address: str,
        component: str,
        draining: threading.Event | None = None,
        stall_watch: StallWatch | None = None,
        security: WireSecurity = LOCAL,
    ) -> None:
        self.address, self.component, self.draining = address, component, draining
        self.stall_watch = stall_watch
        self.security = security
        self.session = os.urandom(8).hex()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and close the thread's sockets (before the context is terminated)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        links = FrontendLinks(
            zmq.Context.instance(),
            self.address,
            f"{self.component}-heartbeat",
            security=self.security,
        )
        try:
            while not self._stop.is_set():
                try:
                    links.refresh()
                    links.send_all(encode(self._message()))
                except Exception:  # a beat missed is no reason to stop beating
                    logger.exception("%s: a heartbeat failed", self.component)
                self._stop.wait(HEARTBEAT_INTERVAL_S)
        finally:
            links.close()

    def _message(self) -> Heartbeat:
        return Heartbeat(
            component=self.component,
            pid=os.getpid(),
            sent_at=time.time(),
            session=self.session,
            draining=self.draining is not None and self.draining.is_set(),
            stalled=self.stall_watch.exit_if_stalled(self.component) if self.stall_watch else None,
        )


def _needs_lookup(address: str) -> bool:
    """A tcp:// address naming a host (not ipc://, inproc://, an IP or *)."""
    if not address.startswith("tcp://"):
        return False
    return not _is_ip(_host_and_port(address)[0])


def _host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address[len("tcp://") :].rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--frontend-address {address!r}: a tcp:// address needs a port")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host == "*"
    return True


def _bracketed(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
