"""Servers that several modules' tests share: each `kvflow serve` start costs half a minute of
CPU, so tests that only send requests to one started with the same flags use one.

Package-scoped: a shared server stops once the tests in this folder are done (on a worker of
pytest-xdist, once its share of them is); tests/conftest.py keeps every test that uses one on
the same worker. A test that kills, drains or reconfigures its server starts its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import Server, start_server

# The tool chat model (SmolLM2's tokenizer, a Hermes tool template, random weights) served with
# tool calls parsed; 64 blocks of 16 tokens: one request of max_model_len (1024) fits, eight long
# ones don't (tests/e2e/test_structured_output.py preempts with them).
TOOL_SERVER_FLAGS = (
    *("--device", "cpu", "--tokenizer-pool-size", "1"),
    *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    *("--num-gpu-blocks-override", "64"),
)


@pytest.fixture(scope="package")
def default_server() -> Iterator[Server]:
    """`kvflow serve` on the embedded SmolLM2 with the default flags."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture(scope="package")
def tool_server(tool_chat_model_dir: Path) -> Iterator[Server]:
    """`kvflow serve` on the tool chat model, tool calls parsed (TOOL_SERVER_FLAGS)."""
    server = start_server(str(tool_chat_model_dir), *TOOL_SERVER_FLAGS)
    yield server
    server.stop()
