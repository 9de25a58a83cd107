"""--lora-modules as vLLM takes it (name=path, or JSON with a base model name), through flags, a
config file and the environment, and its mistakes refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.launcher.cli import build_parser
from shared.config import Config, ConfigError, config_from_args
from shared.lora_modules import LoraModule, LoraModuleError, parse_lora_modules

JSON_B = json.dumps({"name": "b", "path": "/loras/b", "base_model_name": "org/base"})


def test_both_forms_in_order() -> None:
    assert parse_lora_modules(("a=/loras/a", JSON_B)) == [
        LoraModule("a", "/loras/a"),
        LoraModule("b", "/loras/b", "org/base"),
    ]


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("a", "neither name=path"),
        ("=/x", "neither name=path"),
        ("{not json", "not valid JSON"),
        ('{"name": "a"}', "neither name=path"),
        ('{"name": "a", "path": "/x", "rank": 8}', "unknown keys"),
        ('{"name": "a", "path": "/x", "base_model_name": 3}', "must be text"),
    ],
)
def test_bad_entries_are_refused(entry: str, reason: str) -> None:
    with pytest.raises(LoraModuleError, match=reason):
        parse_lora_modules((entry,))


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(LoraModuleError, match="twice"):
        parse_lora_modules(("a=/x", "a=/y"))


def test_flags_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--enable-lora", "--lora-modules", "a=/loras/a", JSON_B])
    assert config_from_args(args).lora_modules == ("a=/loras/a", JSON_B)
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"enable_lora": True, "lora_modules": ["a=/x", "b=/y"]}))
    args = parser.parse_args(["serve", "--config", str(file)])
    assert config_from_args(args).lora_modules == ("a=/x", "b=/y")
    monkeypatch.setenv("KVFLOW_ENABLE_LORA", "1")
    monkeypatch.setenv("KVFLOW_LORA_MODULES", "a=/x b=/y")
    assert config_from_args(parser.parse_args(["serve"])).lora_modules == ("a=/x", "b=/y")
    monkeypatch.setenv("KVFLOW_LORA_MODULES", json.dumps(["a=/x", JSON_B]))
    assert config_from_args(parser.parse_args(["serve"])).lora_modules == ("a=/x", JSON_B)


def test_adapters_need_enable_lora() -> None:
    with pytest.raises(ConfigError, match="need --enable-lora"):
        Config(lora_modules=("a=/x",))
    with pytest.raises(ConfigError, match="need --enable-lora"):
        Config(allow_runtime_lora_updating=True)
    with pytest.raises(ConfigError, match="twice"):
        Config(enable_lora=True, lora_modules=("a=/x", "a=/y"))
    with pytest.raises(ConfigError, match="max-cpu-loras"):
        Config(enable_lora=True, max_loras=4, max_cpu_loras=2)
