"""The two legs of a disaggregated request on the way in (services/tokenizer/handover.py)."""

from __future__ import annotations

from services.tokenizer.handover import HandoverLegs
from shared.protocol import EngineRequest, FinishReason, RequestOutput, SamplingParams


def request(request_id: str = "r", **params: object) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        lora_id=3,
    )


def first_output(request_id: str = "r") -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[42],
        finish_reason=FinishReason.LENGTH,
        handed_over=True,
    )


def test_a_request_goes_to_a_prefill_replica_then_on_to_a_decode_replica() -> None:
    legs = HandoverLegs(num_prefill=2, num_replicas=5)
    sent, among = legs.first_leg(request(max_tokens=9, prompt_logprobs=1))
    assert list(among or ()) == [0, 1]
    assert sent.kv_transfer is not None and sent.kv_transfer.export
    assert sent.sampling_params.prompt_logprobs == 1
    second = legs.second_leg(first_output(), source=1)
    assert second is not None
    assert second.kv_transfer is not None and second.kv_transfer.source == 1
    assert not second.kv_transfer.export
    assert second.output_token_ids == [42] and second.prompt_token_ids == [5, 6, 7]
    assert second.sampling_params.max_tokens == 9 and second.lora_id == 3
    assert second.sampling_params.prompt_logprobs is None  # they came with the first leg
    assert legs.second_leg(first_output(), source=1) is None  # once
    assert list(legs.decode) == [2, 3, 4]


def test_an_embedding_goes_whole_to_a_decode_replica_and_one_engine_splits_nothing() -> None:
    legs = HandoverLegs(num_prefill=1, num_replicas=2)
    sent, among = legs.first_leg(request(embed=True))
    assert list(among or ()) == [1] and sent.kv_transfer is None
    plain = HandoverLegs(num_prefill=0, num_replicas=2)
    assert plain.first_leg(request()) == (request(), None)


def test_a_request_that_ended_has_no_second_leg() -> None:
    legs = HandoverLegs(num_prefill=1, num_replicas=2)
    legs.first_leg(request())
    legs.forget("r")
    assert legs.second_leg(first_output(), source=0) is None
