"""CURVE on real sockets over tcp loopback, as `--curve-key-dir` sets them up: a ROUTER takes
messages only from DEALERs that hold the client key, heartbeats carry the key, and the ZAP
authenticator ends with its context (or the context could never end)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq.auth.thread import AuthenticationThread

from services.frontend.engine.client import EngineClient
from shared.config import Config
from shared.frontend_links import HeartbeatThread
from shared.ipc import Decoder, bind_router, connect_dealer, terminate
from shared.protocol import Heartbeat, ToFrontend
from shared.wire_security import LOCAL, CurveKeys, WireSecurity, make_keys
from tests.integration.curve_peers import GUARD_MS, handshakes

Context = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    make_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def security(keys: Path) -> WireSecurity:
    return WireSecurity.of(Config(curve_key_dir=str(keys)))


@pytest.fixture
def context() -> Iterator[Context]:
    """A context of the test's own, ended as the frontend ends its one (`terminate`) once the
    test has closed its sockets."""
    context: Context = zmq.Context()
    yield context
    assert ends_in_time(lambda: terminate(context))


def ends_in_time(work: object) -> bool:
    """Run `work` on a thread; whether it ended (a hang fails the test instead of stalling it)."""
    thread = threading.Thread(target=work, daemon=True)  # type: ignore[arg-type]
    thread.start()
    thread.join(GUARD_MS / 1000)
    return not thread.is_alive()


def stranger(tmp_path: Path, security: WireSecurity) -> WireSecurity:
    """Knows the server's public key (it is public) but holds a client key of its own."""
    assert security.curve is not None
    make_keys(tmp_path / "other")
    own = CurveKeys.load(str(tmp_path / "other"))
    return WireSecurity(curve=dataclasses.replace(own, server_public=security.curve.server_public))


@pytest.mark.parametrize("peer", ["no CURVE", "a client key of its own"])
def test_only_holders_of_the_client_key_reach_a_curve_router(
    peer: str, tmp_path: Path, security: WireSecurity, context: Context
) -> None:
    router = bind_router(context, "tcp://127.0.0.1:*", security)
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    monitor, outcomes = handshakes(router)
    intruder_security = LOCAL if peer == "no CURVE" else stranger(tmp_path, security)
    intruder = connect_dealer(context, address, "intruder", intruder_security)
    intruder.send(b"from the intruder")
    assert next(outcomes) is False  # refused: its message stays on its side
    holder = connect_dealer(context, address, "holder", security)
    holder.send(b"from the key holder")
    assert True in outcomes
    router.setsockopt(zmq.RCVTIMEO, GUARD_MS)
    assert router.recv_multipart() == [b"holder", b"from the key holder"]
    assert not router.poll(0)
    router.disable_monitor()
    for socket in (monitor, intruder, holder, router):
        socket.close()


def test_heartbeats_reach_a_curve_frontend(security: WireSecurity, context: Context) -> None:
    router = bind_router(context, "tcp://127.0.0.1:*", security)
    router.setsockopt(zmq.RCVTIMEO, GUARD_MS)
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    heartbeat = HeartbeatThread(address, "executor-0", security=security)
    try:
        identity, frame = router.recv_multipart()
    finally:
        heartbeat.stop()
        router.close()
    beat = Decoder(ToFrontend, "test").decode(frame)
    assert identity == b"executor-0-heartbeat"
    assert isinstance(beat, Heartbeat) and beat.component == "executor-0"


def test_the_frontends_engine_client_closes_with_its_authenticator(keys: Path) -> None:
    """Its asyncio context could not end while the authenticator's sockets stay open."""
    before = authenticators()
    engine = EngineClient(Config(frontend_address="tcp://127.0.0.1:0", curve_key_dir=str(keys)))
    [started] = authenticators() - before
    assert ends_in_time(engine.close)
    assert engine.context.closed and not started.is_alive()


def authenticators() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if isinstance(t, AuthenticationThread)}
