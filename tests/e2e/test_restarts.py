"""Components started apart over tcp:// (as compose and Kubernetes run them) outlive each
other's restarts: a new executor or scheduler is adopted, and the frontend never restarts; a
tokenizer worker told to stop drains its requests while another takes the new ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai

from tests.e2e.server import API_KEY, Paused, Server, free_port
from tests.e2e.test_failures import in_engine, stream_in_background, wait_for


class Components:
    """frontend, scheduler, executor and tokenizer workers, each its own process."""

    def __init__(self) -> None:
        self.http_port = free_port()
        frontend, scheduler = free_port(), free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
        self.env["KVFLOW_FRONTEND_ADDRESS"] = f"tcp://127.0.0.1:{frontend}"
        self.env["KVFLOW_SCHEDULER_ADDRESS"] = f"tcp://127.0.0.1:{scheduler}"
        self.env["KVFLOW_MAX_MODEL_LEN"] = "1024"
        self.env["KVFLOW_DRAIN_TIMEOUT"] = "600"  # a drain ends when its requests do
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        args = {
            "frontend": ["frontend", "--port", str(self.http_port), "--api-key", API_KEY],
            "scheduler": ["scheduler"],
            "executor": ["executor"],
            "tokenizer-0": ["tokenizer", "--worker-index", "0"],
            "tokenizer-1": ["tokenizer", "--worker-index", "1"],
        }[name]
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services", *args], env=self.env, stdout=subprocess.DEVNULL
        )

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a worker still draining: this is the end
                proc.kill()
                proc.wait(timeout=30)


def completes(server: Server) -> bool:
    """Whether a greedy completion comes back whole (any error: not yet)."""
    client = server.client(max_retries=0, timeout=300)  # a bound on a stall, not on speed
    try:
        out = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
        )
    except openai.APIError:
        return False
    return out.choices[0].text.startswith(" Paris")


def test_a_restarted_executor_or_scheduler_is_adopted_and_the_frontend_stays() -> None:
    components = Components()
    for name in ("frontend", "scheduler", "executor", "tokenizer-0"):
        components.start(name)
    frontend = components.procs["frontend"]
    server = Server(frontend, components.http_port)
    try:
        wait_for(lambda: completes(server), 240)

        # The executor dies in the middle of a stream: the stream ends with an error (once),
        # and a new executor process is adopted by the running scheduler.
        thread, record = stream_in_background(server, max_tokens=900)
        assert record["started"].wait(60) and record["chunks"] > 0
        components.kill("executor")
        thread.join(60)
        assert not thread.is_alive() and record["error"] is not None
        assert record["finish_reason"] is None  # it did not also end as if complete
        components.start("executor")
        wait_for(lambda: completes(server), 240)

        # The scheduler dies while idle: a new one adopts the running executor.
        components.kill("scheduler")
        components.start("scheduler")
        wait_for(lambda: completes(server), 240)

        alive = ("frontend", "tokenizer-0", "scheduler", "executor")
        assert all(components.procs[name].poll() is None for name in alive)
        assert components.procs["frontend"] is frontend  # never restarted
    finally:
        components.stop()


def test_a_tokenizer_worker_told_to_stop_finishes_its_streams_and_exits_zero() -> None:
    """SIGTERM to a worker (a rolling update, a scale-down): it takes no new requests (the
    frontend sends them to the other worker), finishes the stream it holds, and exits 0. The
    executor is paused from before the stream starts until the frontend has heard that the
    worker drains, so the stream is in flight then, however fast or slow the machine."""
    components = Components()
    for name in ("frontend", "scheduler", "executor", "tokenizer-0", "tokenizer-1"):
        components.start(name)
    server = Server(components.procs["frontend"], components.http_port)
    try:
        wait_for(lambda: completes(server), 240)
        wait_for(lambda: server.metrics()["num_tokenizer_workers"] == 2, 120)
        draining = components.procs["tokenizer-0"]
        # The engine's counts reach the frontend a snapshot later: the completions above are
        # counted out before the stream is counted in.
        wait_for(lambda: in_engine(server) == 0, 120)
        with Paused(components.procs["executor"].pid):
            # Both idle: the stream goes to tokenizer-0 (ties go by name).
            thread, record = stream_in_background(server, max_tokens=16)
            wait_for(lambda: in_engine(server) == 1, 120)
            draining.send_signal(signal.SIGTERM)
            wait_for(lambda: server.metrics()["num_tokenizer_workers"] == 1, 120)
            assert draining.poll() is None and record["chunks"] == 0  # it waits for its stream
        assert completes(server)  # through tokenizer-1
        thread.join(600)
        assert record["finish_reason"] == "length" and record["error"] is None
        assert record["chunks"] > 0  # all streamed through tokenizer-0 while it drained
        assert draining.wait(timeout=120) == 0
        assert completes(server)
    finally:
        components.stop()
