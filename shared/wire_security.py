"""Who may reach kvflow's ZeroMQ sockets: the one place that decides, for every bind and connect.

By default nothing outside this machine can: `kvflow serve` puts its ipc:// sockets in a
folder only its user can enter (`private_runtime_dir`), and a bind to a tcp:// address other
hosts could reach is refused unless `--allow-remote-components` says so. Across hosts,
`--curve-key-dir` turns on CURVE: every ROUTER is a CURVE server that a ZAP authenticator
guards (only the client key of the folder gets in), every DEALER proves it holds that key, and
all traffic is encrypted. Whatever arrives is still only decoded as msgpack into the expected
message types (`shared.ipc.Decoder`): nothing on any socket is unpickled or evaluated.

`kvflow keys DIR` (`make_keys`) writes the folder:

    server.key          the servers' public key: every component
    server.key_secret   the servers' secret key: the components that bind (frontend, scheduler)
    client.key          the clients' public key
    client.key_secret   the clients' secret key: every component (they all connect somewhere)
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from shared.config import Config, ConfigError

logger = logging.getLogger(__name__)
SERVER, CLIENT = "server", "client"  # the two key pairs, named as their files are
KEY_FILES = ("key", "key_secret")  # <name>.key: public; <name>.key_secret: both keys
Z85_KEY_LENGTH = 40  # a 32-byte CURVE key as z85 text
_AUTHENTICATORS: dict[int, ThreadAuthenticator] = {}  # context.underlying -> its ZAP thread


@dataclass(frozen=True)
class CurveKeys:
    """The key folder, read once: z85 keys, as libzmq takes them."""

    directory: str
    server_public: bytes
    server_secret: bytes | None  # only components that bind need it
    client_public: bytes
    client_secret: bytes

    @classmethod
    def load(cls, directory: str) -> CurveKeys:
        """Raises ConfigError, naming the file, for a key that is missing or unreadable."""
        folder = Path(directory)
        server_public = _public_key(folder / f"{SERVER}.key")
        server_file = folder / f"{SERVER}.key_secret"
        server_secret = _key_pair(server_file)[1] if server_file.exists() else None
        client_public, client_secret = _key_pair(folder / f"{CLIENT}.key_secret")
        return cls(directory, server_public, server_secret, client_public, client_secret)

    def server_key(self) -> bytes:
        """The server secret key, which only the components that bind need."""
        if self.server_secret is None:
            raise ConfigError(
                f"--curve-key-dir: {self.directory} has no {SERVER}.key_secret, which a"
                " component that binds (the frontend, the scheduler) needs"
            )
        return self.server_secret


@dataclass(frozen=True)
class WireSecurity:
    """What this process's binds may expose and which keys its sockets use; built once per
    process from the config (`of`) and handed to `bind_router` and `connect_dealer`."""

    allow_remote: bool = False
    curve: CurveKeys | None = None

    @classmethod
    def of(cls, config: Config) -> WireSecurity:
        curve = CurveKeys.load(config.curve_key_dir) if config.curve_key_dir else None
        return cls(config.allow_remote_components, curve)

    def check_bind(self, address: str) -> None:
        """Refuse a bind other hosts could reach unless allowed (and warn when it is, with no
        keys); warn of an ipc:// socket in a folder other users may write."""
        if self.curve is not None:
            self.curve.server_key()  # refuse before there is a socket to leak
        if address.startswith("ipc://"):
            _warn_if_shared(address)
            return
        if address.startswith("inproc://") or _is_loopback(_host(address)):
            return
        if not self.allow_remote:
            raise ConfigError(
                f"{address} is reachable from other hosts: pass --allow-remote-components"
                " (KVFLOW_ALLOW_REMOTE_COMPONENTS=1) to bind it, with --curve-key-dir to"
                " authenticate and encrypt what crosses the network; or bind 127.0.0.1"
            )
        if self.curve is None:
            logger.warning(
                "binding %s with no --curve-key-dir: anyone who reaches it can send requests and"
                " read every output, unauthenticated and unencrypted; keep it on a private"
                " network or pass --curve-key-dir",
                address,
            )
        else:
            logger.info("binding %s, reachable from other hosts (CURVE: keys only)", address)

    def secure_server(self, socket: zmq.Socket[Any]) -> None:
        """Make a ROUTER, before it binds, a CURVE server that takes only the client key."""
        if self.curve is None:
            return
        _start_authenticator(socket.context, self.curve.client_public)
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.curve.server_key())

    def secure_client(self, socket: zmq.Socket[Any]) -> None:
        """Make a DEALER, before it connects, a CURVE client holding the client key."""
        if self.curve is None:
            return
        socket.setsockopt(zmq.CURVE_SERVERKEY, self.curve.server_public)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.client_public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.curve.client_secret)


LOCAL = WireSecurity()  # the defaults: ipc://, inproc:// and loopback binds, no CURVE


def make_keys(directory: Path) -> list[Path]:
    """`kvflow keys DIR`: a server and a client key pair, secret files 0600; never overwrites."""
    files = [directory / f"{name}.{kind}" for name in (SERVER, CLIENT) for kind in KEY_FILES]
    existing = [str(f) for f in files if f.exists()]
    if existing:
        raise ConfigError(f"{', '.join(existing)} exist already: remove them or pick a new folder")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    umask = os.umask(0o077)  # a secret file is never readable by others, not even at first
    try:
        for name in (SERVER, CLIENT):
            public, secret = zmq.auth.create_certificates(directory, name)
            os.chmod(public, 0o644)
            os.chmod(secret, 0o600)
    finally:
        os.umask(umask)
    return files


def private_runtime_dir() -> Path:
    """A new folder for `kvflow serve`'s ipc:// sockets that only this user may enter (0700),
    so no other local user can connect to a socket in it or put another in its place."""
    directory = Path(tempfile.mkdtemp(prefix="kvflow-"))
    info = directory.stat()
    if stat.S_IMODE(info.st_mode) != 0o700 or info.st_uid != os.getuid():
        directory.rmdir()
        raise RuntimeError(f"{directory} came out shared (mode {stat.S_IMODE(info.st_mode):o})")
    return directory


def stop_authenticator(context: zmq.Context[Any]) -> None:
    """Stop the context's ZAP thread, if it has one: its sockets would hold `term` up."""
    authenticator = _AUTHENTICATORS.pop(context.underlying, None)
    if authenticator is not None:
        authenticator.stop()


class _ClientKey:
    """The ZAP check: a CURVE client gets in if it holds the folder's client key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def _start_authenticator(context: zmq.Context[Any], client_public: bytes) -> None:
    """One ZAP thread per context, started before its first CURVE bind: without one, libzmq
    would let any CURVE client in."""
    if context.underlying in _AUTHENTICATORS:
        return
    if not _AUTHENTICATORS:
        atexit.register(_stop_all)
    authenticator = ThreadAuthenticator(context)
    authenticator.configure_curve_callback("*", _ClientKey(client_public))
    authenticator.start()
    _AUTHENTICATORS[context.underlying] = authenticator


def _stop_all() -> None:
    for authenticator in _AUTHENTICATORS.values():
        authenticator.stop()
    _AUTHENTICATORS.clear()


def _public_key(path: Path) -> bytes:
    return _load(path)[0]


def _key_pair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a secret key file; warns if every user may read it."""
    public, secret = _load(path)
    if secret is None or len(secret) != Z85_KEY_LENGTH:
        raise ConfigError(f"--curve-key-dir: {path} holds no valid CURVE secret key")
    if path.stat().st_mode & stat.S_IROTH:
        logger.warning("%s is readable by every user of this machine: chmod 600 it", path)
    return public, secret


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--curve-key-dir: cannot read {path} ({exc}); `kvflow keys DIR` makes the keys"
        ) from None
    if len(public) != Z85_KEY_LENGTH:
        raise ConfigError(f"--curve-key-dir: {path} holds no valid CURVE public key")
    return public, secret


def _host(address: str) -> str:
    """The host of a `transport://host:port` address, without IPv6 brackets."""
    return address.partition("://")[2].rpartition(":")[0].strip("[]")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # *, an interface or a host name: possibly every interface
        return False


def _warn_if_shared(address: str) -> None:
    path = address[len("ipc://") :]
    if path.startswith("@"):  # Linux's abstract namespace: no file, so no permissions
        logger.warning("%s: an abstract socket, which any local user can connect to", address)
        return
    folder = Path(path).resolve().parent
    try:
        mode = folder.stat().st_mode
    except OSError:  # no such folder: the bind says so
        return
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        logger.warning(
            "%s: %s is writable by other users, who could put their own socket in its place;"
            " use a folder only you can write (kvflow serve makes one)",
            address,
            folder,
        )
