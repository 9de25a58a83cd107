"""A component's links to the frontends: one DEALER per frontend behind the address (a list, or
a name resolving to several), kept in step with what the name resolves to."""

from __future__ import annotations

import pytest
import zmq

from services.frontend.engine.client import EngineClient
from shared.config import Config
from shared.frontend_links import FrontendLinks


class Names:
    """A resolver whose answers the test changes."""

    def __init__(self, ips: list[str]) -> None:
        self.ips: list[str] | None = ips
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.ips is None:
            raise OSError("no such host")
        return self.ips


def links_to(address: str, names: Names, missing_grace: float = 0.0) -> FrontendLinks:
    """Links that look up only when the test says (`lookup()`), not on a thread."""
    context = zmq.Context.instance()
    return FrontendLinks(context, address, "scheduler", names, None, missing_grace)


def test_a_name_becomes_one_link_per_address_it_resolves_to() -> None:
    names = Names(["127.0.0.4"])
    links = links_to("tcp://frontend:5557", names)
    try:
        assert list(links.sockets) == ["tcp://127.0.0.4:5557"]
        assert names.asked == [("frontend", 5557)]
        names.ips = ["127.0.0.4", "127.0.0.9"]
        assert links.refresh() == ([], [])  # nothing new until a lookup says so
        links.lookup()
        added, removed = links.refresh()
        assert len(added) == 1 and not removed
        assert sorted(links.sockets) == ["tcp://127.0.0.4:5557", "tcp://127.0.0.9:5557"]
        kept = links.sockets["tcp://127.0.0.9:5557"]
        names.ips = ["127.0.0.9"]
        links.lookup()
        added, removed = links.refresh()
        assert not added and len(removed) == 1 and removed[0].closed
        assert links.sockets == {"tcp://127.0.0.9:5557": kept}
        names.ips = None  # the name does not resolve for a while: keep what is
        links.lookup()
        assert links.refresh() == ([], []) and list(links.sockets) == ["tcp://127.0.0.9:5557"]
    finally:
        links.close()


def test_a_frontend_missing_from_one_answer_is_kept_for_the_grace() -> None:
    names = Names(["127.0.0.4", "127.0.0.9"])
    links = links_to("tcp://frontend:5557", names, missing_grace=3600.0)
    try:
        names.ips = ["127.0.0.4"]
        links.lookup()
        assert links.refresh() == ([], [])  # missing once: not gone
        names.ips = ["127.0.0.4", "127.0.0.9"]
        links.lookup()
        assert links.refresh() == ([], []) and len(links.sockets) == 2
    finally:
        links.close()


def test_a_tcp_address_without_a_port_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="needs a port"):
        links_to("tcp://frontend", Names([]))


def test_ip_addresses_lists_and_ipc_need_no_lookup() -> None:
    names = Names([])
    address = "tcp://127.0.0.1:5557, ipc:///tmp/kvflow-frontend,tcp://[::1]:5557"
    links = links_to(address, names)
    try:
        assert sorted(links.sockets) == [
            "ipc:///tmp/kvflow-frontend",
            "tcp://127.0.0.1:5557",
            "tcp://[::1]:5557",
        ]
        assert names.asked == [] and links.refresh() == ([], [])
    finally:
        links.close()


def test_send_all_reaches_every_frontend() -> None:
    context = zmq.Context.instance()
    routers = [context.socket(zmq.ROUTER) for _ in range(2)]
    ports = [router.bind_to_random_port("tcp://127.0.0.1") for router in routers]
    address = ",".join(f"tcp://127.0.0.1:{port}" for port in ports)
    links = FrontendLinks(context, address, "scheduler")
    try:
        links.send_all(b"stats")
        for router in routers:
            assert router.poll(5000)
            assert router.recv_multipart() == [b"scheduler", b"stats"]
    finally:
        links.close()
        for router in routers:
            router.close()


def test_a_frontend_that_is_not_there_never_blocks_a_send() -> None:
    links = FrontendLinks(zmq.Context.instance(), "tcp://127.0.0.1:9", "scheduler")
    try:
        for _ in range(5000):  # past the queue's high-water mark: dropped, not blocked
            links.send_all(b"beat")
    finally:
        links.close()


def test_a_frontend_binds_one_address_only() -> None:
    with pytest.raises(ValueError, match="binds one --frontend-address"):
        EngineClient(Config(frontend_address="tcp://0.0.0.0:5557,tcp://0.0.0.0:5567"))
