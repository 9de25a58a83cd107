"""Wire safety as a user meets it: `kvflow serve --curve-key-dir` over tcp:// serves through the
official client while a peer without the key is turned away, and a component asked to bind an
address other hosts reach refuses, naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import zmq

from shared.ipc import encode
from shared.protocol import ComponentDown
from shared.wire_security import make_keys
from tests.e2e.server import API_KEY, free_port, start_server
from tests.e2e.test_components import assert_answers
from tests.integration.curve_peers import handshakes


def test_serve_with_curve_keys_over_tcp_serves_key_holders_only(tmp_path: Path) -> None:
    make_keys(tmp_path / "keys")
    frontend = f"tcp://127.0.0.1:{free_port()}"
    server = start_server(
        "--curve-key-dir",
        str(tmp_path / "keys"),
        "--frontend-address",
        frontend,
        "--scheduler-address",
        f"tcp://127.0.0.1:{free_port()}",
    )
    try:
        assert_answers(server.url, API_KEY)
        # Were it let in, this notice would take the engine down.
        intruder = zmq.Context.instance().socket(zmq.DEALER)
        monitor, outcomes = handshakes(intruder)
        intruder.connect(frontend)
        intruder.send(encode(ComponentDown("executor-0", 1)))
        assert next(outcomes) is False
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert_answers(server.url, API_KEY)  # and still serves
        intruder.disable_monitor()
        monitor.close()
        intruder.close(linger=0)
    finally:
        server.stop()
    assert server.proc.returncode == 0  # the frontend's authenticator let its context end


def test_a_component_refuses_an_address_other_hosts_reach() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    done = subprocess.run(
        [sys.executable, "-m", "services", "frontend", "--frontend-address", "tcp://0.0.0.0:0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--allow-remote-components" in done.stderr and "Traceback" not in done.stderr
