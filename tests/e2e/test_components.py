"""Each component started alone over tcp://, as docker-compose and Kubernetes run them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import msgspec
import openai
import zmq

from tests.e2e.server import free_port


def test_components_started_apart_over_tcp() -> None:
    http_port, frontend_port, scheduler_port = free_port(), free_port(), free_port()
    common = [
        "--frontend-address",
        f"tcp://127.0.0.1:{frontend_port}",
        "--max-model-len",
        "512",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    # The scheduler address reaches every component through the environment, as in compose.
    env["KVFLOW_SCHEDULER_ADDRESS"] = f"tcp://127.0.0.1:{scheduler_port}"
    commands = [
        ["frontend", "--port", str(http_port)],
        ["scheduler"],
        ["executor"],
        ["tokenizer"],  # two replicas with no index, named after host and process
        ["tokenizer"],
    ]
    procs = [
        subprocess.Popen([sys.executable, "-m", "services", *cmd, *common], env=env)
        for cmd in commands
    ]
    try:
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 240
        while True:
            assert all(p.poll() is None for p in procs), "a component exited"
            assert time.monotonic() < deadline, "the components never became healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        while "kvflow:num_tokenizer_workers{" + 'model_name="SmolLM2-135M-Instruct"} 2' not in (
            httpx.get(f"{url}/metrics").text
        ):
            assert time.monotonic() < deadline, "the second tokenizer worker never joined"
            time.sleep(0.25)
        send_garbage(f"tcp://127.0.0.1:{frontend_port}", f"tcp://127.0.0.1:{scheduler_port}")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        out = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
        )
        assert out.choices[0].text.startswith(" Paris")
        assert all(p.poll() is None for p in procs), "malformed messages killed a component"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def send_garbage(*addresses: str) -> None:
    """Malformed and unexpected messages: each must be logged and dropped, never fatal."""
    context = zmq.Context.instance()
    bad = [
        b"\xff\x00garbage",
        msgspec.msgpack.encode({"type": "EngineRequest"}),
        msgspec.msgpack.encode(["not", "a", "message"]),
        b"",
    ]
    for address in addresses:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(address)
        for payload in bad:
            socket.send(payload)
        socket.close()
