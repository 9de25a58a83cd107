"""Start `kvflow serve` as a real subprocess on a free port, read its /metrics, and pause one
of its processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai

API_KEY = "sk-kvflow-test"


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and not one this process was given before: the kernel
    may hand the same free port out twice in a row, and a test that asks for two (the HTTP
    port and a scheduler's address) then gets one process failing to bind."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


@dataclass
class Server:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers()).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^kvflow:(\w+)\{([^}]*)\} (\S+)$", line)
            if match is None or match.group(1).endswith("_bucket"):
                continue
            reason = re.search(r'finished_reason="(\w+)"', match.group(2))
            name = match.group(1) + (f":{reason.group(1)}" if reason else "")
            values[name] = float(match.group(3))
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once nothing runs, nothing waits and no KV block is referenced."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            idle = (
                values.get("num_requests_running"),
                values.get("num_requests_waiting"),
                values.get("kv_cache_usage_perc"),
            ) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                return values
            time.sleep(0.1)

    def child_pid(self, component: str) -> int:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid), "-f", f"services {component}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert out, f"no {component} process under kvflow serve"
        return int(out[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Paused:
    """A process stopped (SIGSTOP) for the block, then resumed: alive, its connections open,
    but it does nothing, as a process starved of CPU would. Tests pause the executor where
    requests must still be in flight (or pile up) when something happens, whatever the
    machine's speed. One that died meanwhile is left be."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> Paused:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *_: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


def start_server(*flags: str, timeout: float = 240.0) -> Server:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services",
            "serve",
            "--port",
            str(port),
            "--api-key",
            API_KEY,
            "--max-model-len",
            "1024",
            *flags,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=sys.stderr,
    )
    server = Server(proc, port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvflow serve exited with {proc.returncode} during startup")
        try:
            if httpx.get(f"{server.url}/ready", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise TimeoutError("kvflow serve did not become healthy")
