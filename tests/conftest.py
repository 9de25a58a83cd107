"""Shared fixtures: a tiny random Llama saved as a Hugging Face folder, and the embedded model."""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which only takes effect when set
# before anything (transformers included) first imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One compute thread in each test process and in every process it starts (OMP_NUM_THREADS,
# inherited). The suite runs several test processes, each with its servers, on a few cores;
# OpenMP threads that spin while they wait for each other then take turns on the cores with
# every other process, and a CPU forward pass became 3-20 times slower (the HTTP fuzz: 75 s
# with one thread, 264 s with two, beside three busy processes on 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import transformers

from kvflow import LLM

# Which tests share a pytest-xdist worker (`as`: hooks of this conftest).
from tests.xdist_groups import pytest_collection_modifyitems as pytest_collection_modifyitems
from tests.xdist_groups import pytest_configure as pytest_configure
from tests.xdist_groups import pytest_configure_node as pytest_configure_node
from tests.xdist_groups import pytest_unconfigure as pytest_unconfigure
from tests.xdist_groups import pytest_xdist_make_scheduler as pytest_xdist_make_scheduler

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process: torch has started


class _DroppedEngines:
    """Engines a test dropped, given back to the machine. A test that wraps an engine's
    methods (a recording, a padded graph) ties it in a reference cycle, which only a full
    collection frees, and full collections are rare in a process this large: three test
    processes each kept 3-4 GiB of dropped engines (1 GiB of KV cache each) and the kernel
    killed one. After a test that left the process 512 MiB larger than after the last
    collection, collect, and return freed heap pages to the system (`malloc_trim`)."""

    GROWTH = 512 << 20

    def __init__(self) -> None:
        self.trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's
        self.floor = self.resident()

    @staticmethod
    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def release_if_grown(self) -> None:
        if self.resident() - self.floor > self.GROWTH:
            gc.collect()
            if self.trim is not None:
                self.trim(0)
            self.floor = self.resident()


_dropped_engines = _DroppedEngines()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's fixtures torn down, a module's too after its last test
    _dropped_engines.release_if_grown()


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
    from shared.config import Config
    from shared.hf_tokenizer import load_tokenizer
    from shared.model_config import resolve_model_source

    return load_tokenizer(resolve_model_source(None), None, Config().cache_dir)


@pytest.fixture(scope="session")
def tool_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and a tool-rendering chat template."""
    from tests.tool_chat_model import save_tool_chat_model

    return save_tool_chat_model(tmp_path_factory.mktemp("tool-chat"), smollm2_tokenizer)
