"""LoRA adapters through a real `kvflow serve` and the official `openai` client: adapters of
--lora-modules listed with their parents and named as the `model`, one batch of requests for
two adapters and the base model giving what offline generation gives, adapters loaded and
unloaded at run time while requests run, and clear errors for unknown models and bad
adapters. With two engine replicas: an adapter loaded at run time serves on both as soon as
the load answers, an unload removes it from both, and two loads of one name at once leave
one adapter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from kvflow import LLM, LoRARequest, SamplingParams
from tests.e2e.server import Server, start_server
from tests.e2e.test_data_parallel import per_replica
from tests.e2e.test_failures import wait_for

peft = pytest.importorskip("peft")

PROMPTS = [[1, 17, 230, 4001, 77], [9, 8, 7, 6, 5, 4, 3, 2], [4242, 31, 1999]]
MAX_TOKENS = 12
SERVED = "tiny"


def save_adapter(base: Path, folder: Path, seed: int, **options: object) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(
        init_lora_weights=False, **{"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
        | options,
    )  # fmt: skip
    peft.get_peft_model(model, config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def adapters(tool_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("loras")
    base = tool_chat_model_dir
    return {
        "a": save_adapter(base, root / "a", 1),
        "b": save_adapter(base, root / "b", 2, target_modules=["q_proj", "v_proj"], r=4),
        "c": save_adapter(base, root / "c", 3, target_modules=["gate_proj", "down_proj"], r=16),
        "rank-32": save_adapter(base, root / "rank-32", 4, r=32),
    }


@pytest.fixture(scope="module")
def expected(tool_chat_model_dir: Path, adapters: dict) -> dict[str | None, list[str]]:
    """Offline greedy text for each prompt under the base model and adapters a, b, c (the
    offline path is checked token for token against peft in tests/integration/test_lora.py)."""
    llm = LLM(str(tool_chat_model_dir), dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts: dict[str | None, list[str]] = {}
    for lora_id, name in enumerate([None, "a", "b", "c"]):
        lora = None if name is None else LoRARequest(name, lora_id, str(adapters[name]))
        texts[name] = [r.text for r in llm.generate(PROMPTS, params, lora_request=lora)]
    for name in "abc":  # else an adapter lost on the way would go unnoticed
        assert texts[name] != texts[None], name
    return texts


@pytest.fixture(scope="module")
def server(tool_chat_model_dir: Path, adapters: dict):
    server = start_server(
        str(tool_chat_model_dir),
        "--served-model-name", SERVED,
        "--enable-lora",
        "--max-loras", "2",
        "--max-lora-rank", "16",
        "--lora-modules", f"a={adapters['a']}",
        json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": "tiny-base"}),
        "--allow-runtime-lora-updating",
    )  # fmt: skip
    yield server
    server.stop()


def complete(server: Server, model: str) -> list[str]:
    async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> str:
        response = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return response.choices[0].text

    async def all_prompts() -> list[str]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in PROMPTS))

    return asyncio.run(all_prompts())


def lora_call(server: Server, route: str, **body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=server.headers(), timeout=60)


def test_models_lists_the_adapters_with_their_parents(server: Server, adapters: dict) -> None:
    cards = {m.id: m.model_dump() for m in server.client().models.list().data}
    assert list(cards) == [SERVED, "a", "b"]
    assert cards[SERVED]["parent"] is None
    assert (cards["a"]["parent"], cards["a"]["root"]) == (SERVED, str(adapters["a"]))
    assert cards["b"]["parent"] == "tiny-base"
    assert server.client().models.retrieve("b").id == "b"


def test_requests_name_an_adapter_as_their_model(server: Server, expected: dict) -> None:
    """Two adapters and the base model at once (a step mixes them), as offline."""

    async def everything() -> list[list[str]]:
        return await asyncio.gather(
            *(asyncio.to_thread(complete, server, model) for model in (SERVED, "a", "b"))
        )

    base, a, b = asyncio.run(everything())
    assert (base, a, b) == (expected[None], expected["a"], expected["b"])
    response = server.client().completions.create(model="a", prompt=PROMPTS[0], max_tokens=2)
    assert response.model == "a"


def test_unknown_models_get_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("nope")


def test_load_use_and_unload_an_adapter_at_run_time(
    server: Server, adapters: dict, expected: dict
) -> None:
    response = lora_call(server, "load_lora_adapter", lora_name="c", lora_path=str(adapters["c"]))
    assert response.status_code == 200, response.text
    assert "c" in [m.id for m in server.client().models.list().data]

    # Three adapters, two slots: the scheduler holds requests back until one is free.
    async def three() -> list[list[str]]:
        return await asyncio.gather(
            *(asyncio.to_thread(complete, server, model) for model in ("a", "b", "c"))
        )

    assert asyncio.run(three()) == [expected["a"], expected["b"], expected["c"]]
    again = lora_call(server, "load_lora_adapter", lora_name="c", lora_path=str(adapters["c"]))
    assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
    assert lora_call(server, "unload_lora_adapter", lora_name="c").status_code == 200
    assert "c" not in [m.id for m in server.client().models.list().data]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="c", prompt=PROMPTS[0], max_tokens=2)
    gone = lora_call(server, "unload_lora_adapter", lora_name="c")
    assert gone.status_code == 404 and "no LoRA adapter" in gone.json()["error"]["message"]
    # Loaded again, it is a new adapter (a new id): the same output.
    response = lora_call(server, "load_lora_adapter", lora_name="c", lora_path=str(adapters["c"]))
    assert response.status_code == 200 and complete(server, "c") == expected["c"]


def test_bad_adapters_are_refused_by_name(server: Server, adapters: dict, tmp_path: Path) -> None:
    cases = {
        str(tmp_path / "missing"): "adapter_config.json",
        str(adapters["rank-32"]): "rank 32",
    }
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    config = (adapters["a"] / "adapter_config.json").read_text()
    (pickled / "adapter_config.json").write_text(config)
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    cases[str(pickled)] = "pickle"
    for path, reason in cases.items():
        response = lora_call(server, "load_lora_adapter", lora_name="bad", lora_path=path)
        assert response.status_code == 400, response.text
        assert reason in response.json()["error"]["message"]
    assert "bad" not in [m.id for m in server.client().models.list().data]
    no_key = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert no_key.status_code == 401
    # Nothing else broke.
    assert complete(server, "a")[0] == complete(server, "a")[0]


@pytest.fixture(scope="module")
def two_replicas(tool_chat_model_dir: Path):
    server = start_server(
        str(tool_chat_model_dir),
        "--served-model-name", SERVED,
        "--data-parallel-size", "2",
        "--data-parallel-routing", "round-robin",  # one worker: requests alternate replicas
        "--tokenizer-pool-size", "1",
        "--enable-lora",
        "--max-loras", "2",
        "--max-lora-rank", "16",
        "--allow-runtime-lora-updating",
    )  # fmt: skip
    yield server
    server.stop()


def test_two_replicas_serve_an_adapter_loaded_at_run_time_until_it_is_unloaded(
    two_replicas: Server, adapters: dict, expected: dict
) -> None:
    server = two_replicas
    before = per_replica(server, "prompt_tokens_total")
    response = lora_call(server, "load_lora_adapter", lora_name="c", lora_path=str(adapters["c"]))
    assert response.status_code == 200, response.text
    # Right after the answer, both replicas run requests for it (in turn), with its tokens.
    assert complete(server, "c") == expected["c"]
    assert complete(server, "c") == expected["c"]

    def both_ran_some() -> bool:
        now = per_replica(server, "prompt_tokens_total")
        return all(now.get(r, 0) > before.get(r, 0) for r in (0, 1))

    wait_for(both_ran_some, timeout=10)  # the replicas' figures come every second
    assert lora_call(server, "unload_lora_adapter", lora_name="c").status_code == 200
    assert "c" not in [m.id for m in server.client().models.list().data]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="c", prompt=PROMPTS[0], max_tokens=2)
    # Gone from both: neither says it has one of that name when it is loaded again.
    response = lora_call(server, "load_lora_adapter", lora_name="c", lora_path=str(adapters["c"]))
    assert response.status_code == 200, response.text
    assert complete(server, "c") == expected["c"]


def test_two_loads_of_one_name_at_once_leave_one_adapter_on_both_replicas(
    two_replicas: Server, adapters: dict, expected: dict
) -> None:
    server = two_replicas

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=server.headers(), timeout=60) as client:
            url = f"{server.url}/v1/load_lora_adapter"
            return await asyncio.gather(
                *(client.post(url, json={"lora_name": "d", "lora_path": str(adapters[source])})
                  for source in ("a", "b"))
            )  # fmt: skip

    responses = asyncio.run(both())
    assert sorted(r.status_code for r in responses) == [200, 400], [r.text for r in responses]
    refused = next(r for r in responses if r.status_code == 400)
    assert "loaded already" in refused.json()["error"]["message"]
    source = "a" if responses[0].status_code == 200 else "b"
    cards = [m for m in server.client().models.list().data if m.id == "d"]
    assert [card.model_dump()["root"] for card in cards] == [str(adapters[source])]
    assert complete(server, "d") == expected[source]  # on both replicas, in turn
    assert complete(server, "d") == expected[source]
