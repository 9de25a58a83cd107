"""Each component started alone over tcp://, as docker-compose and Kubernetes run them; two
frontends in front of one engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import openai
import zmq

from tests.e2e.server import Paused, free_port


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
        while not healthy(url):
            assert all(p.poll() is None for p in procs), "a component exited"
            assert time.monotonic() < deadline, "the components never became healthy"
            time.sleep(0.25)
        while "kvflow:num_tokenizer_workers{" + 'model_name="SmolLM2-135M-Instruct"} 2' not in (
            httpx.get(f"{url}/metrics").text
        ):
            assert time.monotonic() < deadline, "the second tokenizer worker never joined"
            time.sleep(0.25)
        send_garbage(f"tcp://127.0.0.1:{frontend_port}", f"tcp://127.0.0.1:{scheduler_port}")
        assert_answers(url)
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


def test_two_frontends_share_one_engine_and_one_drains_alone() -> None:
    """The components report to every frontend they are given (a list here; a name that
    resolves to several in compose or Kubernetes): both serve, each sees the whole engine,
    and one told to stop drains and exits while the other serves on."""
    http_ports, zmq_ports = [free_port(), free_port()], [free_port(), free_port()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env["KVFLOW_SCHEDULER_ADDRESS"] = f"tcp://127.0.0.1:{free_port()}"
    env["KVFLOW_MAX_MODEL_LEN"] = "512"
    env["KVFLOW_DRAIN_TIMEOUT"] = "600"  # a drain ends when its requests do
    both = ",".join(f"tcp://127.0.0.1:{port}" for port in zmq_ports)
    commands = [
        ["frontend", "--port", str(http), "--frontend-address", f"tcp://127.0.0.1:{port}"]
        for http, port in zip(http_ports, zmq_ports, strict=True)
    ]
    commands += [[c, "--frontend-address", both] for c in ("scheduler", "executor", "tokenizer")]
    procs = [
        subprocess.Popen([sys.executable, "-m", "services", *cmd], env=env) for cmd in commands
    ]
    urls = [f"http://127.0.0.1:{port}" for port in http_ports]
    try:
        deadline = time.monotonic() + 240
        while not all(healthy(url) for url in urls):
            assert all(p.poll() is None for p in procs), "a component exited"
            assert time.monotonic() < deadline, "the frontends never both became healthy"
            time.sleep(0.25)
        for url in urls:
            assert_answers(url)
        # A stream through the first frontend finishes while it drains: the executor is paused
        # from before it starts until that frontend says it drains, so it is in flight then.
        finish: list[str | None] = []

        def stream() -> None:
            client = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key="unused", timeout=300)
            events = client.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt="Count:",
                max_tokens=8,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for event in events:
                finish.append(event.choices[0].finish_reason)

        reader = threading.Thread(target=stream)
        until = time.monotonic() + 120
        # The engine's counts reach the frontends a snapshot later: the requests above are
        # counted out before the stream is counted in.
        while in_engine(urls[1]) != 0:
            assert time.monotonic() < until, "the engine never went idle"
            time.sleep(0.1)
        with Paused(procs[3].pid):  # the executor
            reader.start()
            while in_engine(urls[1]) != 1:
                assert time.monotonic() < until, "the stream never reached the engine"
                time.sleep(0.1)
            procs[0].send_signal(signal.SIGTERM)
            while healthy(urls[0]):
                assert time.monotonic() < until, "the first frontend never said it drains"
                time.sleep(0.1)
        reader.join(600)
        assert finish and finish[-1] == "length"
        assert procs[0].wait(timeout=120) == 0
        client = openai.OpenAI(base_url=f"{urls[1]}/v1", api_key="unused")
        out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens == 2 and healthy(urls[1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def assert_answers(url: str, api_key: str = "unused") -> None:
    """A greedy completion through the frontend at `url` comes back right."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
    out = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
    )
    assert out.choices[0].text.startswith(" Paris")


def in_engine(url: str) -> int:
    """Requests the scheduler holds, running or waiting, as a frontend's /metrics says."""
    held = 0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(("kvflow:num_requests_running{", "kvflow:num_requests_waiting{")):
            held += int(float(line.split()[-1]))
    return held


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
