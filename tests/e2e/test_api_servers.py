"""`kvflow serve --api-server-count 2`: two frontend processes take connections on one port,
requests over fresh connections are served whichever takes them, /metrics on either counts
every frontend's requests, and SIGINT drains both (serve exits 0)."""

from __future__ import annotations

import subprocess
import time

from tests.e2e.server import start_server

NUM_REQUESTS = 12


def test_two_frontends_share_the_port_and_their_metrics() -> None:
    server = start_server("--api-server-count", "2")
    try:
        frontends = subprocess.run(
            ["pgrep", "-P", str(server.proc.pid), "-f", "services frontend"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(frontends) == 2
        for n in range(NUM_REQUESTS):  # a new client each: a new connection, either frontend
            with server.client() as client:
                completion = client.completions.create(
                    model="SmolLM2-135M-Instruct", prompt=f"Count to {n}:", max_tokens=4
                )
            assert completion.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 30
        counted = 0.0
        while counted != NUM_REQUESTS and time.monotonic() < deadline:
            time.sleep(0.2)  # each frontend shares its figures every second
            counted = server.metrics().get("request_success_total:length", 0.0)
        assert counted == NUM_REQUESTS
    finally:
        server.stop()
    assert server.proc.returncode == 0
