"""Wire safety without a peer: which binds are refused or warned about, the private folder of
`kvflow serve`'s ipc:// sockets, and the CURVE key files (`kvflow keys`, and reading them)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from services.launcher.cli import main
from services.launcher.serve import Launcher
from shared.config import Config, ConfigError
from shared.ipc import bind_router, connect_dealer
from shared.wire_security import LOCAL, CurveKeys, WireSecurity, make_keys, private_runtime_dir

LOGGER = "shared.wire_security"
LOCAL_BINDS = [
    "ipc:///run/kvflow/frontend",
    "inproc://frontend",
    "tcp://127.0.0.1:5557",
    "tcp://127.8.0.1:5557",
    "tcp://[::1]:5557",
    "tcp://localhost:5557",
    "tcp://127.0.0.1:*",
]
REMOTE_BINDS = [
    "tcp://0.0.0.0:5557",
    "tcp://*:5557",
    "tcp://[::]:5557",
    "tcp://10.0.0.4:5557",
    "tcp://eth0:5557",
    "tcp://kvflow-frontend:5557",
]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    make_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """This module's records at the level the test captures (WARNING, or INFO)."""
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("address", LOCAL_BINDS)
def test_local_binds_need_no_flag(address: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        LOCAL.check_bind(address)
    assert logged(caplog) == []


@pytest.mark.parametrize("address", REMOTE_BINDS)
def test_a_bind_other_hosts_reach_needs_the_flag(address: str) -> None:
    with pytest.raises(ConfigError, match="--allow-remote-components") as refused:
        LOCAL.check_bind(address)
    assert address in str(refused.value)


def test_an_allowed_remote_bind_warns_unless_it_has_keys(
    keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        WireSecurity(allow_remote=True).check_bind("tcp://0.0.0.0:5557")
    [(level, message)] = logged(caplog)
    assert level == logging.WARNING and "--curve-key-dir" in message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        WireSecurity(True, CurveKeys.load(str(keys))).check_bind("tcp://*:5557")
    [(level, message)] = logged(caplog)
    assert level == logging.INFO and "tcp://*:5557" in message


def test_every_bind_goes_through_the_check(
    context: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError, match="--allow-remote-components"):
        bind_router(context, "tcp://0.0.0.0:*")
    security = WireSecurity.of(Config(allow_remote_components=True))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bind_router(context, "tcp://0.0.0.0:*", security).close()
    assert [level for level, _ in logged(caplog)] == [logging.WARNING]


def test_an_ipc_socket_in_a_folder_others_may_write_is_warned_about(
    tmp_path: Path, context: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bind_router(context, f"ipc://{private}/frontend").close()
        assert logged(caplog) == []
        bind_router(context, f"ipc://{shared}/frontend").close()
    [(level, message)] = logged(caplog)
    assert level == logging.WARNING and str(shared) in message


def test_serve_puts_its_sockets_in_a_folder_only_its_user_may_enter() -> None:
    launcher = Launcher(Config())
    try:
        info = launcher.runtime.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        for address in (launcher.config.frontend_address, launcher.config.scheduler_address):
            assert address is not None and address.startswith(f"ipc://{launcher.runtime}/")
    finally:
        shutil.rmtree(launcher.runtime)


def test_a_runtime_folder_that_came_out_shared_is_refused() -> None:
    umask = os.umask(0o070 | 0o100)  # mkdtemp's 0700 loses the owner's x: not 0700 any more
    try:
        with pytest.raises(RuntimeError, match="came out shared"):
            private_runtime_dir()
    finally:
        os.umask(umask)


def test_keys_are_two_pairs_whose_secrets_only_their_owner_reads(tmp_path: Path) -> None:
    assert main(["keys", str(tmp_path / "keys")]) == 0
    folder = tmp_path / "keys"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes == {
        "server.key": 0o644,
        "server.key_secret": 0o600,
        "client.key": 0o644,
        "client.key_secret": 0o600,
    }
    keys = CurveKeys.load(str(folder))
    assert (keys.server_public, keys.server_secret) == zmq.auth.load_certificate(
        folder / "server.key_secret"
    )
    assert (keys.client_public, keys.client_secret) == zmq.auth.load_certificate(
        folder / "client.key_secret"
    )
    assert keys.client_public == zmq.auth.load_certificate(folder / "client.key")[0]


def test_keys_are_never_overwritten(keys: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (keys / "server.key_secret").read_bytes()
    assert main(["keys", str(keys)]) == 2
    assert "exist already" in capsys.readouterr().err
    assert (keys / "server.key_secret").read_bytes() == before


@pytest.mark.parametrize("name", ["server.key", "client.key_secret"])
def test_a_missing_key_file_is_a_config_error_naming_it(keys: Path, name: str) -> None:
    (keys / name).unlink()
    with pytest.raises(ConfigError, match=f"--curve-key-dir: cannot read .*{re.escape(name)}"):
        WireSecurity.of(Config(curve_key_dir=str(keys)))


def test_a_file_holding_no_key_is_a_config_error(keys: Path) -> None:
    (keys / "client.key_secret").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(ConfigError, match=r"client\.key_secret holds no valid CURVE"):
        CurveKeys.load(str(keys))


def test_a_secret_key_every_user_may_read_is_warned_about(
    keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (keys / "client.key_secret").chmod(0o644)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        CurveKeys.load(str(keys))
    [(_, message)] = logged(caplog)
    assert "client.key_secret" in message and "chmod 600" in message


def test_components_that_only_connect_need_no_server_secret(
    keys: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    (keys / "server.key_secret").unlink()
    security = WireSecurity.of(Config(curve_key_dir=str(keys)))
    connect_dealer(context, "tcp://127.0.0.1:9", "tokenizer-0", security).close()
    with pytest.raises(ConfigError, match=r"server\.key_secret"):
        bind_router(context, "tcp://127.0.0.1:*", security)
