"""Config layering: defaults < --config file < KVFLOW_* environment < flags; clear errors."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from services.launcher.cli import ALL_GROUPS
from shared.config import (
    OFFLINE_DEFAULTS,
    Config,
    ConfigError,
    add_config_flags,
    config_from_args,
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ALL_GROUPS)
    return parser.parse_args(argv)


def test_layers_override_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "kvflow.toml"
    file.write_text("max_num_seqs = 8\nblock_size = 32\nmax_model_len = 512\n")
    monkeypatch.setenv("KVFLOW_BLOCK_SIZE", "64")
    monkeypatch.setenv("KVFLOW_ENABLE_PREFIX_CACHING", "false")
    config = config_from_args(parse(["--config", str(file), "--max-model-len", "1024"]))
    assert config.max_num_seqs == 8  # file
    assert config.block_size == 64  # env beats file
    assert config.enable_prefix_caching is False  # env boolean
    assert config.max_model_len == 1024  # flag beats file
    assert config.max_num_batched_tokens == Config().max_num_batched_tokens  # default


def test_offline_defaults_sit_between_field_defaults_and_what_a_user_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline = OFFLINE_DEFAULTS["max_num_batched_tokens"]
    assert offline != Config().max_num_batched_tokens
    assert config_from_args(parse([]), defaults=OFFLINE_DEFAULTS).max_num_batched_tokens == offline
    file = tmp_path / "kvflow.toml"
    file.write_text("max_num_batched_tokens = 4096\n")
    by_file = config_from_args(parse(["--config", str(file)]), defaults=OFFLINE_DEFAULTS)
    assert by_file.max_num_batched_tokens == 4096
    monkeypatch.setenv("KVFLOW_MAX_NUM_BATCHED_TOKENS", "1024")
    assert config_from_args(parse([]), defaults=OFFLINE_DEFAULTS).max_num_batched_tokens == 1024
    by_flag = config_from_args(
        parse(["--max-num-batched-tokens", "512"]), defaults=OFFLINE_DEFAULTS
    )
    assert by_flag.max_num_batched_tokens == 512


def test_boolean_flags_have_a_negative_form() -> None:
    assert config_from_args(parse(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert config_from_args(parse([])).enable_prefix_caching is True


@pytest.mark.parametrize(
    ("argv", "frontends"),
    [
        ([], 1),
        (["--data-parallel-size", "2"], 4),  # two per replica
        (["--data-parallel-size", "2", "--api-server-count", "1"], 1),
        (["--api-server-count", "3"], 3),
        (["--data-parallel-size", "2", "--frontend-address", "ipc:///tmp/f"], 1),  # its one
    ],
)
def test_serve_starts_two_frontends_per_replica_unless_told(
    argv: list[str], frontends: int
) -> None:
    assert config_from_args(parse(argv)).frontends == frontends


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--block-size", "12"], "--block-size"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--max-model-len", "abc"], "max_model_len"),
        (["--request-timeout", "0"], "--request-timeout"),
        (["--max-queued-tokens", "0"], "--max-queued-tokens"),
        (["--max-logprobs", "0"], "--max-logprobs"),
        (["--engine-stall-timeout", "-1"], "--engine-stall-timeout"),
        (["--api-server-count", "0"], "--api-server-count"),
        (["--prefill-replicas", "1"], "--prefill-replicas"),  # no decode replica left
        (["--data-parallel-size", "2", "--prefill-replicas", "2"], "--prefill-replicas"),
        (["--data-parallel-size", "2", "--prefill-replicas", "-1"], "--prefill-replicas"),
        (["--kv-buffer-device", "cuda"], "--kv-buffer-device"),  # no prefill replica
        (["--kv-buffer-size", "2"], "--kv-buffer-size"),
        (
            [*("--data-parallel-size", "2", "--prefill-replicas", "1", "--kv-buffer-size", "0")],
            "--kv-buffer-size",
        ),
        (
            [
                *("--data-parallel-size", "2", "--prefill-replicas", "1", "--device", "cpu"),
                *("--kv-buffer-device", "cuda"),
            ],
            "--kv-buffer-device",
        ),
        (
            [
                *("--data-parallel-size", "2", "--prefill-replicas", "1"),
                *(
                    "--speculative-config",
                    '{"method": "eagle3", "model": "/x", "num_speculative_tokens": 2}',
                ),
            ],
            "--prefill-replicas",
        ),
        (
            [*("--data-parallel-size", "2", "--kv-transfer-address", "ipc:///a")],
            "--kv-transfer-address",
        ),
    ],
)
def test_invalid_values_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        config_from_args(parse(argv))


def test_unknown_file_keys_are_rejected(tmp_path: Path) -> None:
    file = tmp_path / "kvflow.json"
    file.write_text('{"max_num_seqz": 3}')
    with pytest.raises(ConfigError, match="max_num_seqz"):
        config_from_args(parse(["--config", str(file)]))


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--dtype", "half"], "dtype", "float16"),
        (["--dtype", "float"], "dtype", "float32"),
        (["--kv-cache-dtype", "fp8_e4m3"], "kv_cache_dtype", "fp8"),
        (["--quantization", "awq_marlin"], "quantization", "awq"),
        (["--quantization", "gptq_marlin"], "quantization", "gptq"),
        (["--quantization", "gptq"], "quantization", "gptq"),
    ],
)
def test_vllm_spellings_mean_the_same_value(argv: list[str], field: str, value: str) -> None:
    assert getattr(config_from_args(parse(argv)), field) == value


def test_a_kv_cache_format_kvflow_lacks_is_refused() -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype"):
        Config(kv_cache_dtype="fp8_e5m2")


# -- the startup log's line: what differs from the defaults, secrets masked

SECRET = "sk-very-secret-0123"


def test_the_summary_of_the_defaults_is_empty() -> None:
    assert Config().non_default_summary() == "{}"
    assert config_from_args(parse([])).non_default_summary() == "{}"


def test_the_summary_names_only_the_changed_fields() -> None:
    config = config_from_args(
        parse(
            [
                "--port",
                "8001",
                "--max-num-seqs",
                "256",
                "--dtype",
                "half",
                "--no-enable-prefix-caching",
            ]
        )
    )  # --max-num-seqs 256 is its default
    assert config.non_default_summary() == (
        "{'dtype': 'float16', 'enable_prefix_caching': False, 'port': 8001}"
    )


def test_the_summary_never_holds_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_API_KEY", f"{SECRET},{SECRET}-2")
    config = config_from_args(parse(["--api-key-file", "/run/keys"]))
    summary = config.non_default_summary()
    assert SECRET not in summary
    assert "'api_key': '***'" in summary
    assert "'api_key_file': '/run/keys'" in summary  # where the keys are is no secret


def test_every_field_that_holds_a_secret_is_masked() -> None:
    """A field named as a credential is declared secret, unless it holds where one is kept."""
    where_kept = {"api_key_file", "curve_key_dir"}
    credentials = {"key", "secret", "token", "password", "credential"}
    named = {f.name for f in fields(Config) if credentials & set(f.name.split("_"))}
    secret = {f.name for f in fields(Config) if f.metadata["secret"]}
    assert named - where_kept == secret == {"api_key"}
    everything = {f.name: SECRET for f in fields(Config) if f.name in secret}
    assert SECRET not in Config(**everything).non_default_summary()


def test_the_summary_stays_short_for_a_served_config() -> None:
    config = Config(
        model="/models/Qwen3-8B",
        tensor_parallel_size=2,
        api_key=SECRET,
        scheduler_address="ipc:///tmp/kvflow-abc/scheduler",
        frontend_address="ipc:///tmp/kvflow-abc/frontend-0",
        api_server_count=1,
    )
    assert len(config.non_default_summary()) < 250


def test_an_embedding_model_takes_offline_steps_unless_told(tmp_path: Path) -> None:
    from services.launcher.cli import build_parser, component_config

    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (tmp_path / "modules.json").write_text("[]")  # sentence-transformers: an embedding model

    def budget(*argv: str) -> int:
        return component_config(build_parser().parse_args(["serve", *argv])).max_num_batched_tokens

    offline = OFFLINE_DEFAULTS["max_num_batched_tokens"]
    assert budget(str(tmp_path)) == budget(str(tmp_path), "--task", "embed") == offline
    assert budget(str(tmp_path), "--max-num-batched-tokens", "4096") == 4096
    assert budget(str(tmp_path), "--task", "generate") == budget() == 2048  # serve's own
