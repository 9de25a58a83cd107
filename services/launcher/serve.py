"""`kvflow serve`: start every component on this machine, watch them, stop them together.

Components talk over ipc:// sockets in a private runtime directory (or the tcp:// addresses
given). If any process dies, the frontend is told at once (in-flight requests end with an
error, /health turns 503), and serve exits non-zero so a supervisor restarts it. With several
engine replicas, a replica's process that dies fails only that replica's requests: the others
drain (as below), then serve exits non-zero. SIGTERM drains: the frontend stops admitting and
finishes what is in flight, then all exit 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import zmq

from services.frontend.metrics.share import share_file
from shared.config import ENV_PREFIX, Config
from shared.constants import DEATH_GRACE_S, UNHEALTHY_LIMIT_S
from shared.ipc import connect_dealer, encode
from shared.protocol import ComponentDown
from shared.replicas import (
    experts_across_replicas,
    replica_devices,
    replica_gpus,
    replica_name,
    replica_of,
)
from shared.wire_security import WireSecurity, private_runtime_dir

logger = logging.getLogger(__name__)
SHARE_SILENCE_S = 5.0  # a frontend writes its metrics file every second


def listening_sockets(config: Config, count: int) -> list[socket.socket]:
    """One HTTP socket for each of `count` frontends, all listening on --host and --port,
    joined by SO_REUSEPORT (Linux), so the kernel spreads new connections evenly over the
    frontends. One socket shared by all let whichever frontend woke first take most of a
    burst: on two H200s serving 1,000 requests at once, one frontend sat at a full core for
    seconds while the other idled, and its streams stalled for up to 2.9 s. A plain bind comes
    first, so a port that another server holds stops serve instead of being shared with it."""
    _bound(config.host, config.port, reuse_port=False).close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(_bound(config.host, config.port, reuse_port=True))
            sockets[-1].listen(2048)
    except OSError:
        for listener in sockets:
            listener.close()
        raise
    return sockets


def _bound(host: str, port: int, reuse_port: bool) -> socket.socket:
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener


class Launcher:
    def __init__(self, config: Config) -> None:
        self.security = WireSecurity.of(config)  # a key it cannot read stops serve right here
        self.gpus = replica_gpus(config)  # too few: serve stops right here too
        count = config.frontends
        if count > 1 and config.frontend_address is not None:
            raise ValueError("--api-server-count > 1 picks the frontends' addresses itself")
        # Several frontends take connections on one port, each from a socket bound here: a
        # port that another server holds stops serve now, and never ends up shared with it.
        self.listeners = listening_sockets(config, count) if count > 1 else []
        self.runtime = private_runtime_dir()  # 0700: no other user reaches the ipc:// sockets
        # One address per frontend (--api-server-count): each binds its own, the components
        # report to all of them, and the frontends share the HTTP port and their metrics.
        self.frontend_addresses = self._frontend_addresses(config)
        self.config = config.replace(
            api_server_count=count,  # as resolved (with frontend_address set, it reads as 1)
            frontend_address=",".join(self.frontend_addresses),
            scheduler_address=config.scheduler_address or self._private("scheduler", config),
        )
        if count > 1:
            (self.runtime / "metrics").mkdir()
            self.config = self.config.replace(metrics_share_dir=str(self.runtime / "metrics"))
        if experts_across_replicas(config) and config.data_parallel_group is None:
            # The replicas' executors meet there (services/executor/parallel/world.py).
            (self.runtime / "replica-group").mkdir()
            self.config = self.config.replace(
                data_parallel_group=str(self.runtime / "replica-group")
            )
        if config.data_parallel_size > 1 and config.kv_events_address is None:
            # The tokenizer workers route by the replicas' KV events.
            self.config = self.config.replace(kv_events_address=self._private("kv-events", config))
        if config.prefill_replicas and config.kv_transfer_address is None:
            # The prefill replicas' executors hand KV over to the decode replicas' there.
            address = self._private("kv-transfer", config)
            self.config = self.config.replace(kv_transfer_address=address)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self._start_all()
            if not self._wait_ready():
                # A signal before serve said it serves still drains: a frontend may have
                # taken requests already (serve also waits for every frontend's ready file).
                return self._drain() if self.stopping else 1
            return self._watch()
        finally:
            self._stop_all()
            shutil.rmtree(self.runtime, ignore_errors=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stopping:  # a second signal: stop now
            self._stop_all()
            sys.exit(1)
        logger.info("received %s: draining", signal.Signals(signum).name)
        self.stopping = True
        # Now, not at the watch loop's next turn: new requests are refused from this moment.
        for frontend in self._frontends():
            if frontend.poll() is None:
                frontend.send_signal(signal.SIGTERM)

    # ---------------------------------------------------------------- processes

    def _start_all(self) -> None:
        config_path = self.runtime / "config.json"
        config_path.write_text(json.dumps(dataclasses.asdict(self.config)))
        # The file holds the resolved config; KVFLOW_* variables must not override it again.
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        base = [sys.executable, "-m", "services"]
        args = ["--config", str(config_path), "--supervised"]
        for k, address in enumerate(self.frontend_addresses):
            own = ["--frontend-address", address, "--ready-file", str(self._ready_file(k))]
            fds: tuple[int, ...] = ()
            if self.listeners:
                fds = (self.listeners[k].fileno(),)
                own += ["--listen-fd", str(fds[0])]
            self._spawn(self._frontend_name(k), [*base, "frontend", *args, *own], env, fds)
        # Each frontend holds its own now: a socket left open here would keep taking its share
        # of connections after its frontend closed it (draining), for nobody to accept.
        for listener in self.listeners:
            listener.close()
        replicas = self.config.data_parallel_size
        for r in range(replicas):
            rank = ["--data-parallel-rank", str(r)]
            self._spawn(
                replica_name("scheduler", r, replicas), [*base, "scheduler", *args, *rank], env
            )
            executor_env = {**env, **replica_devices(self.gpus, r, self.config)}
            self._spawn(
                replica_name("executor-0", r, replicas),
                [*base, "executor", *args, *rank],
                executor_env,
            )
        for k in range(self.config.tokenizer_pool_size):
            self._spawn(
                f"tokenizer-{k}", [*base, "tokenizer", *args, "--worker-index", str(k)], env
            )

    def _frontend_addresses(self, config: Config) -> list[str]:
        count = config.frontends
        if count == 1:
            return [config.frontend_address or f"ipc://{self.runtime}/frontend"]
        return [f"ipc://{self.runtime}/frontend-{k}" for k in range(count)]

    def _frontend_name(self, k: int) -> str:
        return "frontend" if len(self.frontend_addresses) == 1 else f"frontend-{k}"

    def _frontends(self) -> list[subprocess.Popen[bytes]]:
        names = (self._frontend_name(k) for k in range(len(self.frontend_addresses)))
        return [self.procs[name] for name in names if name in self.procs]

    def _ready_file(self, k: int) -> Path:
        return self.runtime / f"frontend-{k}.ready"

    def _private(self, name: str, config: Config) -> str:
        """ipc:// addresses in the runtime folder: one, or one per engine replica."""
        replicas = config.data_parallel_size
        if replicas == 1:
            return f"ipc://{self.runtime}/{name}"
        return ",".join(f"ipc://{self.runtime}/{name}-{r}" for r in range(replicas))

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str], fds: tuple[int, ...] = ()
    ) -> None:
        self.procs[name] = subprocess.Popen(argv, env=env, start_new_session=True, pass_fds=fds)

    def _dead(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    @property
    def _base_url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        return f"http://{host}:{self.config.port}"

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline and not self.stopping:
            dead = self._dead()
            if dead is not None:
                logger.error("%s exited with code %d during startup", *dead)
                return False
            frontends_ready = all(
                self._ready_file(k).exists() for k in range(len(self.frontend_addresses))
            )
            if frontends_ready and self._probe("/ready"):
                logger.info(
                    "kvflow is serving %s at %s",
                    self.config.model or "the embedded SmolLM2-135M-Instruct",
                    self._base_url,
                )
                return True
            time.sleep(0.2)
        if not self.stopping:
            logger.error("startup did not finish")
        return False

    def _watch(self) -> int:
        healthy_at = time.monotonic()
        while not self.stopping:
            dead = self._dead()
            if dead is not None:
                return self._after_death(*dead)
            silent = self._silent_frontend()
            if self._probe("/health") and silent is None:
                healthy_at = time.monotonic()
            elif time.monotonic() - healthy_at > UNHEALTHY_LIMIT_S and not self.stopping:
                logger.error(
                    "unhealthy for %d s (%s is hung); stopping kvflow",
                    UNHEALTHY_LIMIT_S, silent or "a component",
                )  # fmt: skip
                return 1
            time.sleep(0.5)
        return self._drain()

    def _after_death(self, name: str, code: int) -> int:
        """A process died: tell the frontends; then stop, or, where it was one engine replica's
        of several, let the others finish their requests first. Non-zero either way."""
        self._tell_frontend(name, code)
        if replica_of(name, self.config) is None or self.config.data_parallel_size == 1:
            logger.error("%s exited with code %d; stopping kvflow", name, code)
            time.sleep(DEATH_GRACE_S)
            return 1
        logger.error(
            "%s exited with code %d: its replica's requests fail; draining the others, then"
            " stopping kvflow", name, code,
        )  # fmt: skip
        self.stopping = True
        for frontend in self._frontends():
            if frontend.poll() is None:
                frontend.send_signal(signal.SIGTERM)
        self._drain()
        return 1

    def _silent_frontend(self) -> str | None:
        """A frontend that has not written its metrics file for SHARE_SILENCE_S: its loop is
        stuck (a probe through the port reaches one frontend of several, at random)."""
        folder = self.config.metrics_share_dir
        if folder is None:
            return None
        for k, proc in enumerate(self._frontends()):
            try:
                age = time.time() - share_file(folder, str(proc.pid)).stat().st_mtime
            except FileNotFoundError:
                age = float("inf")
            if age > SHARE_SILENCE_S:
                return self._frontend_name(k)
        return None

    def _probe(self, path: str) -> bool:
        """Whether /ready (startup) or /health (afterwards: alive) answers 200."""
        try:
            with urllib.request.urlopen(self._base_url + path, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _tell_frontend(self, name: str, code: int) -> None:
        """Tell every frontend still running that a component died (its requests fail now)."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        for k, address in enumerate(self.frontend_addresses):
            if self._frontend_name(k) == name:
                continue
            socket = connect_dealer(context, address, "launcher", self.security)
            socket.send(encode(ComponentDown(name, code)))
            time.sleep(0.1)  # LINGER is 0: give the message time to leave
            socket.close()

    def _drain(self) -> int:
        deadline = time.monotonic() + self.config.drain_timeout + 10
        codes = []
        for frontend in self._frontends():  # told to drain by _on_signal
            try:
                codes.append(frontend.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                logger.error("a frontend did not drain in time")
                return 1
        logger.info("drained; frontends exited with codes %s", codes)
        return 0 if not any(codes) else 1

    def _stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
