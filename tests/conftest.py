"""Shared fixtures: a tiny random Llama saved as a Hugging Face folder, and the embedded model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which only takes effect when set
# before anything (transformers included) first imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers

from kvflow import LLM

# Tests run in several processes (pytest-xdist, --dist loadgroup: pyproject.toml). A fixture
# wider than a test but narrower than the session (a `kvflow serve`, a loaded reference model, a
# fuzzed component) is built in each process that runs a test needing it; so tests that share
# one (the same fixture, with the same parameter) are kept on one process, as an xdist_group:
# a package-scoped one (tests/e2e/conftest.py's shared servers) wherever they are, a module- or
# class-scoped one within its module. Docker tests share one engine and compose project: one
# process runs them, one at a time. Session fixtures are built once per process.


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = _Groups()
    keyed = [(item, _shared_fixtures(item)) for item in items]
    for _, keys in keyed:
        for key in keys[1:]:
            groups.join(keys[0], key)
    for item, keys in keyed:
        if keys and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups.name(keys[0])))


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """What the test shares with others: the wider-than-a-test fixtures it uses (by module and
    parameter), or Docker."""
    if item.get_closest_marker("docker") is not None:
        return ["docker"]
    info = getattr(item, "_fixtureinfo", None)  # a Function's; other items have no fixtures
    if info is None:
        return []
    callspec = getattr(item, "callspec", None)
    indices = callspec.indices if callspec is not None else {}
    module = item.nodeid.split("::")[0]
    keys = []
    for name, defs in sorted(info.name2fixturedefs.items()):
        scope = defs[-1].scope
        if scope in ("module", "class", "package"):
            where = "" if scope == "package" else f"{module}::"
            param = f"[{indices[name]}]" if name in indices else ""
            keys.append(f"{where}{name}{param}")
    return keys


class _Groups:
    """Union-find over fixture keys: tests joined through any shared fixture form one group,
    named by its widest fixture (package-scoped first), then in sorted order."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def join(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            first, second = sorted((ra, rb), key=lambda key: ("::" in key, key))
            self.parent[second] = first

    def name(self, key: str) -> str:
        return self.find(key)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return Path(folder)


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    """The embedded SmolLM2-135M-Instruct, loaded once for every test that reads text. Its KV
    cache is 256 MiB (5,800 tokens), not the CPU default of 1 GiB: it lives as long as the test
    process, beside the servers and models of other tests."""
    return LLM(dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from shared.hf_tokenizer import load_tokenizer
    from shared.model_config import resolve_model_source

    return load_tokenizer(resolve_model_source(None))


@pytest.fixture(scope="session")
def tool_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and a tool-rendering chat template."""
    from tests.tool_chat_model import save_tool_chat_model

    return save_tool_chat_model(tmp_path_factory.mktemp("tool-chat"), smollm2_tokenizer)
