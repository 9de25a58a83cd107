"""The scheduler builds its core from the executor's report, and refuses flags that disagree."""

from __future__ import annotations

import msgspec
import pytest

from services.scheduler.handshake import refuse_other_versions, scheduler_config
from shared.config import Config, ConfigError
from shared.ipc import Decoder, encode
from shared.protocol import PROTOCOL_VERSION, ExecutorReady, ToScheduler

READY = ExecutorReady(
    protocol_version=PROTOCOL_VERSION,
    model_name="SmolLM2-135M-Instruct",
    vocab_size=49152,
    eos_token_ids=[2],
    max_model_len=2048,
    block_size=16,
    num_blocks=1000,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
)


def test_the_core_takes_the_executors_facts_and_the_schedulers_policies() -> None:
    config = Config(enable_prefix_caching=False, max_queued_requests=7)
    built = scheduler_config(config, READY)
    assert (built.num_blocks, built.max_model_len, built.vocab_size) == (1000, 2048, 49152)
    assert built.eos_token_ids == (2,)
    assert (built.block_size, built.max_num_seqs, built.max_num_batched_tokens) == (16, 256, 2048)
    assert (built.enable_prefix_caching, built.max_queued_requests) == (False, 7)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"max_num_seqs": 128}, "--max-num-seqs 128 (executor: 256)"),
        ({"block_size": 32}, "--block-size 32 (executor: 16)"),
        ({"max_num_batched_tokens": 8192}, "--max-num-batched-tokens 8192 (executor: 2048)"),
        ({"max_model_len": 1024}, "--max-model-len 1024 (executor: 2048)"),
    ],
)
def test_flags_that_disagree_with_the_executor_are_refused(flags: dict, named: str) -> None:
    with pytest.raises(ConfigError, match="disagree") as error:
        scheduler_config(Config(**flags), READY)
    assert named in str(error.value)


def test_a_draft_model_reserves_its_drafts_as_lookahead_slots() -> None:
    ready = msgspec.structs.replace(READY, num_speculative_tokens=3)
    draft = Config(speculative_config='{"model": "/m/draft", "num_speculative_tokens": 3}')
    ngram = Config(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert scheduler_config(draft, ready).num_lookahead_tokens == 3
    assert scheduler_config(ngram, ready).num_lookahead_tokens == 0
    assert scheduler_config(ngram, ready).num_speculative_tokens == 3


def test_an_unset_max_model_len_takes_the_executors() -> None:
    assert scheduler_config(Config(max_model_len=None), READY).max_model_len == 2048
    assert scheduler_config(Config(max_model_len=2048), READY).max_model_len == 2048


def test_another_protocol_version_is_refused() -> None:
    old = msgspec.structs.replace(READY, protocol_version=PROTOCOL_VERSION - 1)
    with pytest.raises(ConfigError, match="protocol"):
        scheduler_config(Config(), old)


def test_an_older_executors_report_is_refused_by_its_version_not_dropped() -> None:
    """A version-1 ExecutorReady has other fields: it does not decode as this version's, and
    the scheduler reads its version alone to say why."""
    v1_frame = msgspec.msgpack.encode(
        {
            "type": "ExecutorReady",
            "protocol_version": 1,
            "num_blocks": 9,
            "max_model_len": 512,
            "model_name": "m",
        }
    )
    assert Decoder(ToScheduler, "scheduler").decode(v1_frame) is None
    with pytest.raises(ConfigError, match="the executor speaks protocol 1"):
        refuse_other_versions(v1_frame)
    refuse_other_versions(b"\xc1 not msgpack")  # other garbage: only dropped
    refuse_other_versions(encode(READY))  # this version's: nothing to refuse
