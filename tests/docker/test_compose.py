"""`docker compose up` for real: the image builds with no registry, the split stack serves
through the official client, outlives a crashed executor without restarting the frontend,
scales its tokenizer pool, drains on SIGTERM, and `docker compose down` leaves nothing behind.

Needs a Docker engine with the compose plugin (scripts/docker_engine.sh starts one on CI).
Where none answers the test is skipped, unless KVFLOW_TEST_DOCKER=1 demands it, as CI does.

The image is built from this checkout and tagged, and the stack named, after it, so that runs
from several checkouts on one Docker engine never share an image or a container. Nothing
here waits for the machine to be fast: where a request must still be running when something
happens, the executor is paused (`docker pause`) until the test has seen what it needs; every
wait is for an event (a metric, a probe's answer, a stream's end) with a loose bound; and the
frontend's drain, 30 s in the compose file, is raised to 600 s (an override file), so that a
drain ends when its requests do: a loaded 2-core machine decoded 0.3 tokens a second.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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
import yaml

from shared.config import ENV_PREFIX, config_from_args
from tests.e2e.server import free_port

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]
PROJECT = f"kvflow-test-{CHECKOUT}"
# docker/build.sh and docker-compose.yml read KVFLOW_IMAGE; .ci/run builds the image before the
# tests start (KVFLOW_TEST_IMAGE, see build_image).
IMAGE = os.environ.get("KVFLOW_TEST_IMAGE", f"kvflow-test:{CHECKOUT}")
MODEL = "SmolLM2-135M-Instruct"
# The first test's setup may wait out the image's build (build_image).
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1500)]


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], cwd=ROOT, capture_output=True, text=True, check=check, timeout=600
    )


DRAIN_OVERRIDE = """\
services:
  frontend:
    environment:
      KVFLOW_DRAIN_TIMEOUT: "600"
"""
COMPOSE_FILES: list[str] = []  # the stack's, once the fixture has written the override


def compose(*args: str, env: dict[str, str] | None = None) -> str:
    files = {"COMPOSE_FILE": ":".join(COMPOSE_FILES)} if COMPOSE_FILES else {}
    result = subprocess.run(
        ["docker", "compose", "-p", PROJECT, *args],
        cwd=ROOT,
        env={**os.environ, "KVFLOW_IMAGE": IMAGE, **files, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
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


def build_image() -> None:
    """Build IMAGE from this checkout, or, where .ci/run builds it beside the install, wait
    for that build to end: its exit status lands in the file KVFLOW_TEST_IMAGE_STATUS names,
    the log's tail beside it."""
    status_file = os.environ.get("KVFLOW_TEST_IMAGE_STATUS")
    if status_file is None:
        build = subprocess.run(
            ["bash", "docker/build.sh"],
            cwd=ROOT,
            env={**os.environ, "KVFLOW_IMAGE": IMAGE},
            capture_output=True,
            text=True,
        )
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        return
    status = Path(status_file)
    wait_until(status.exists, 1200, f"the build of {IMAGE} never ended")
    tail = status.with_name("tail.log")
    assert status.read_text().strip() == "0", tail.read_text() if tail.exists() else ""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_docker()
    override = tmp_path_factory.mktemp("compose") / "drain.yml"
    override.write_text(DRAIN_OVERRIDE)
    COMPOSE_FILES[:] = [str(ROOT / "docker-compose.yml"), str(override)]
    build_image()
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
        COMPOSE_FILES.clear()
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


def ready_message(base: str) -> str | None:
    """What /ready says when it is not 200 ("the engine is unavailable: draining"); None while
    it is 200 or does not answer."""
    try:
        response = httpx.get(f"{base}/ready", timeout=5)
    except httpx.HTTPError:
        return None
    return None if response.status_code == 200 else response.json()["error"]["message"]


def client(base: str, timeout: float = 300) -> openai.OpenAI:
    """An OpenAI client whose timeout bounds a stall, not how fast tokens come."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout)


@contextlib.contextmanager
def paused(service: str) -> Iterator[None]:
    """The service's container frozen (`docker pause`) for the block: alive, connections open,
    but not a step runs, as a process starved of CPU would be."""
    docker("pause", f"{PROJECT}-{service}-1")
    try:
        yield
    finally:
        docker("unpause", f"{PROJECT}-{service}-1")


def kill_kvflow(service: str) -> None:
    """SIGKILL the kvflow process of the service's container (docker-init's one child)."""
    init = container(service)["State"]["Pid"]
    [child] = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    os.kill(int(child), signal.SIGKILL)


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
    names = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.disaggregated.yml")
    files = [str(ROOT / name) for name in names]
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
    disaggregated = ("-f", "docker-compose.yml", "-f", "docker-compose.disaggregated.yml")
    compose(*disaggregated, "config", "--quiet")


def test_the_disaggregated_engines_read_settings_kvflow_accepts(monkeypatch) -> None:
    """Each engine container of docker-compose.disaggregated.yml, as kvflow reads its settings:
    its replica, its own scheduler to bind or reach, the prefill executor's KV address."""
    files = [ROOT / "docker-compose.yml", ROOT / "docker-compose.disaggregated.yml"]
    base, override = (yaml.safe_load(path.read_text()) for path in files)
    expected = {
        "prefill-scheduler": (0, "tcp://0.0.0.0:5558"),
        "prefill-executor": (0, "tcp://prefill-scheduler:5558"),
        "decode-scheduler": (1, "tcp://0.0.0.0:5558"),
        "decode-executor": (1, "tcp://decode-scheduler:5558"),
    }
    for service, (replica, scheduler) in expected.items():
        for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(name)
        for name, value in override["services"][service]["environment"].items():
            monkeypatch.setenv(name, value)
        config = config_from_args(argparse.Namespace())
        assert (config.replica, config.data_parallel_size, config.prefill_replicas) == (
            replica,
            2,
            1,
        )
        assert config.replica_address("scheduler_address") == scheduler
        assert config.addresses("kv_transfer_address")[0] == "tcp://prefill-executor:5560"
    assert set(base["services"]) - set(override["services"]) == {"prometheus", "grafana"}
    assert override["services"]["scheduler"]["profiles"] == ["single-engine"]


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
    kill_kvflow("executor")
    wait_until(lambda: container("executor")["RestartCount"] >= 1, 120, "never restarted")
    wait_until(lambda: completes(url), 300, "the stack did not serve again")
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
    other two complete, and the restarted worker joins again.

    The executor is paused from before the streams start until the killed worker's stream has
    ended: all three are in flight when the worker dies, however fast the machine, and the two
    live workers, which have nothing to send all that while, must not be taken for dead."""
    port = url.rsplit(":", 1)[1]
    compose("up", "-d", "--no-recreate", "--scale", "tokenizer=3", env={"KVFLOW_HOST_PORT": port})
    wait_until(
        lambda: gauge(url, "kvflow:num_tokenizer_workers") == 3,
        300,
        "the third worker never joined",
    )
    results: dict[int, str] = {}

    def stream(k: int) -> None:
        try:  # a stream cut before its first token fails with a status, later with an event
            events = client(url).completions.create(
                model=MODEL,
                prompt="Count:",
                max_tokens=8,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finish = [e.choices[0].finish_reason for e in events if e.choices][-1]
            results[k] = str(finish)
        except openai.APIError as exc:
            results[k] = f"error: {exc}"
        except Exception as exc:  # anything else, named in the assertion's message
            results[k] = f"error: {type(exc).__name__}: {exc}"

    readers = [threading.Thread(target=stream, args=(k,)) for k in range(3)]
    with paused("executor"):
        for reader in readers:
            reader.start()
        wait_until(lambda: in_engine(url) == 3, 300, "the streams never reached the engine")
        kill_kvflow("tokenizer")
        wait_until(lambda: len(results) == 1, 300, "the killed worker's stream never ended")
    for reader in readers:
        reader.join(300)
    failed, *completed = sorted(results.values())  # "error: ..." sorts first
    if not (completed == ["length", "length"] and "tokenizer" in failed):
        logs = compose("logs", "--no-color", "--tail", "40", "scheduler", "executor")
        raise AssertionError(f"{results}\n{logs[-6000:]}")  # CI shows a failure's message
    wait_until(
        lambda: gauge(url, "kvflow:num_tokenizer_workers") == 3,
        300,
        "the restarted worker never joined",
    )
    wait_until(lambda: completes(url), 300, "the stack did not serve again")


def in_engine(base: str) -> int:
    """Requests the scheduler holds, running or waiting (with the executor paused, requests
    may wait for a step that cannot come)."""
    return gauge(base, "kvflow:num_requests_running") + gauge(base, "kvflow:num_requests_waiting")


def test_sigterm_drains_the_frontend_then_it_exits_zero(url: str) -> None:
    """Last in this module: the frontend stays stopped after it. A stream in flight at SIGTERM
    (held there: the executor is paused until the frontend says it drains) completes, /ready
    says "draining" and new requests are refused meanwhile, and the frontend exits 0."""
    record: dict = {"text": "", "finish": None, "error": None}

    def stream() -> None:
        try:
            events = client(url).completions.create(
                model=MODEL,
                prompt="Tell a story:",
                max_tokens=8,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for event in events:
                record["text"] += event.choices[0].text
                record["finish"] = event.choices[0].finish_reason or record["finish"]
        except openai.APIError as exc:
            record["error"] = str(exc)

    reader = threading.Thread(target=stream)
    stop = threading.Thread(target=compose, args=("stop", "--timeout", "660", "frontend"))
    with paused("executor"):
        reader.start()
        wait_until(lambda: in_engine(url) == 1, 300, "the stream never reached the engine")
        stop.start()
        wait_until(
            lambda: ready_message(url) == "the engine is unavailable: draining",
            300,
            "/ready never said draining",
        )
        refused = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60
        )
        assert refused.status_code == 503 and "shutting down" in refused.text
    reader.join(600)
    stop.join(600)
    assert record["error"] is None and record["finish"] == "length", record
    assert record["text"]
    state = container("frontend")["State"]
    assert state["Status"] == "exited" and state["ExitCode"] == 0
