"""`docker compose up` for real: the image builds with no registry, the split stack serves
through the official client, outlives a crashed executor without restarting the frontend,
scales its tokenizer pool, drains on SIGTERM, and `docker compose down` leaves nothing behind.

Needs a Docker engine with the compose plugin (scripts/docker_engine.sh starts one on CI).
Where none answers the test is skipped, unless KVFLOW_TEST_DOCKER=1 demands it, as CI does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import free_port

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kvflow-test"
MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.docker


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], cwd=ROOT, capture_output=True, text=True, check=check, timeout=600
    )


def compose(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        ["docker", "compose", "-p", PROJECT, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def container(service: str) -> dict:
    """`docker inspect` of the service's container."""
    return json.loads(docker("inspect", f"{PROJECT}-{service}-1").stdout)[0]


def require_docker() -> None:
    demanded = os.environ.get("KVFLOW_TEST_DOCKER") == "1"
    try:
        ok = docker("info", check=False).returncode == 0
        ok = ok and docker("compose", "version", check=False).returncode == 0
    except FileNotFoundError:
        ok = False
    if not ok:
        if demanded:
            pytest.fail("KVFLOW_TEST_DOCKER=1 but no Docker engine with compose answers")
        pytest.skip("no Docker engine with compose (scripts/docker_engine.sh starts one)")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    require_docker()
    build = subprocess.run(["bash", "docker/build.sh"], cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    port = free_port()
    compose("up", "-d", env={"KVFLOW_HOST_PORT": str(port)})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(base), 300, "the stack never became healthy")
        yield base
    finally:
        print(compose("logs", "--no-color", "--timestamps", "--tail", "60"))  # shown on failure
        compose("down", "--timeout", "60")
        left = docker("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "-q")
        networks = docker("network", "ls", "--filter", f"name={PROJECT}", "-q")
        assert left.stdout.strip() == networks.stdout.strip() == "", "compose down left some"


def wait_until(condition, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.5)


def healthy(base: str) -> bool:
    """Ready: serving new requests (/health stays 200 while starting and draining)."""
    try:
        return httpx.get(f"{base}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def completes(base: str) -> bool:
    try:
        out = client(base).completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
        )
    except openai.APIError:
        return False
    return out.choices[0].text.startswith(" Paris")


def test_compose_files_match_the_compose_spec() -> None:
    """The schema docker compose itself follows (check-jsonschema's vendored copy); needs no
    Docker engine."""
    files = [str(ROOT / name) for name in ("docker-compose.yml", "docker-compose.gpu.yml")]
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            *files,
        ],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_compose_files_validate() -> None:
    require_docker()
    compose("config", "--quiet")
    compose("-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml", "config", "--quiet")


def test_completions_and_chat_stream_through_the_split_stack(url: str) -> None:
    assert completes(url)
    stream = client(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    services = [
        c["Service"] for c in map(json.loads, compose("ps", "--format", "json").splitlines())
    ]
    assert sorted(services) == ["executor", "frontend", "scheduler", "tokenizer", "tokenizer"]
    for service in ("frontend", "scheduler", "executor", "tokenizer"):
        inspected = container(service)  # as the Helm chart runs them: read-only, not root
        assert inspected["HostConfig"]["ReadonlyRootfs"] and inspected["Config"]["User"] == "kvflow"


def test_a_crashed_executor_is_restarted_and_the_frontend_serves_on(url: str) -> None:
    frontend = container("frontend")
    init = container("executor")["State"]["Pid"]  # docker-init; kvflow is its child
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    assert len(children) == 1
    os.kill(int(children[0]), signal.SIGKILL)
    wait_until(lambda: container("executor")["RestartCount"] >= 1, 60, "never restarted")
    wait_until(lambda: completes(url), 180, "the stack did not serve again")
    after = container("frontend")
    assert after["Id"] == frontend["Id"] and after["RestartCount"] == frontend["RestartCount"]
    assert after["State"]["StartedAt"] == frontend["State"]["StartedAt"]


def gauge(base: str, name: str) -> int:
    """A gauge of the frontend's /metrics, e.g. kvflow:num_tokenizer_workers."""
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return int(float(line.split()[-1]))
    raise AssertionError(f"no {name} in /metrics")


def test_tokenizers_scale_and_a_crashed_one_fails_only_its_own_streams(url: str) -> None:
    """`--scale tokenizer=3` grows the pool with no other change; three streams go one to each
    worker (least loaded); killing one worker ends its stream with an error, not a hang, the
    other two complete, and the restarted worker joins again."""
    port = url.rsplit(":", 1)[1]
    compose("up", "-d", "--no-recreate", "--scale", "tokenizer=3", env={"KVFLOW_HOST_PORT": port})
    wait_until(
        lambda: gauge(url, "kvflow:num_tokenizer_workers") == 3,
        120,
        "the third worker never joined",
    )
    results: list[str] = []

    def stream() -> None:
        try:  # a stream cut before its first token fails with a status, later with an event
            events = client(url).completions.create(
                model=MODEL,
                prompt="Count:",
                max_tokens=600,  # long enough to be running when a worker is killed
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finish = [e.choices[0].finish_reason for e in events if e.choices][-1]
            results.append(str(finish))
        except openai.APIError as exc:
            results.append(f"error: {exc}")

    readers = [threading.Thread(target=stream) for _ in range(3)]
    for reader in readers:
        reader.start()
    wait_until(
        lambda: gauge(url, "kvflow:num_requests_running") == 3, 60, "the streams never all ran"
    )
    init = container("tokenizer")["State"]["Pid"]
    [child] = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    os.kill(int(child), signal.SIGKILL)
    for reader in readers:
        reader.join(180)
    failed, *completed = sorted(results)  # "error: ..." sorts first
    assert completed == ["length", "length"] and "tokenizer" in failed, results
    wait_until(
        lambda: gauge(url, "kvflow:num_tokenizer_workers") == 3,
        120,
        "the restarted worker never joined",
    )
    assert completes(url)


def test_sigterm_drains_the_frontend_then_it_exits_zero(url: str) -> None:
    """Last in this module: the frontend stays stopped after it."""
    record: dict = {"text": "", "finish": None}

    def stream() -> None:
        events = client(url).completions.create(
            model=MODEL,
            prompt="Tell a story:",
            max_tokens=100,  # long enough to be running at SIGTERM, short enough for the drain
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for event in events:
            record["text"] += event.choices[0].text
            record["finish"] = event.choices[0].finish_reason or record["finish"]

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: bool(record["text"]), 60, "the stream never started")
    stop = threading.Thread(target=compose, args=("stop", "--timeout", "40", "frontend"))
    stop.start()
    # Draining: not ready any more, at once, while the stream goes on.
    wait_until(lambda: not healthy(url), 10, "/ready stayed 200 while draining")
    reader.join(60)
    stop.join(60)
    assert record["finish"] == "length"  # the running stream completed
    state = container("frontend")["State"]
    assert state["Status"] == "exited" and state["ExitCode"] == 0
