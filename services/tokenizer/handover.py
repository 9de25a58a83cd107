"""Prefill/decode disaggregation on the way in (--prefill-replicas): the two legs of a request.

    first leg   to a prefill replica, as admitted, marked to hand over (KVTransfer.export):
                it computes the prompt and the first token, which streams to the client
    second leg  once that output says `handed_over`: to a decode replica, with the first
                token as an output already made and the prefill replica to fetch the
                prompt's KV from (KVTransfer.source); it generates the rest

A request that ends with its first token (a stop, max_tokens 1, a stop string found here)
has no second leg. An embedding has nothing to decode: it goes whole to a decode replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shared.protocol import EngineRequest, KVTransfer, RequestOutput


class HandoverLegs:
    def __init__(self, num_prefill: int, num_replicas: int) -> None:
        self.prefill = range(num_prefill)
        self.decode = range(num_prefill, num_replicas)
        self._waiting: dict[str, EngineRequest] = {}  # first legs not handed over yet

    def first_leg(self, request: EngineRequest) -> tuple[EngineRequest, Sequence[int] | None]:
        """What to send, and the replicas to pick from (None: any)."""
        if not self.prefill:
            return request, None
        if request.sampling_params.embed:
            return request, self.decode
        self._waiting[request.request_id] = request
        return msgspec.structs.replace(request, kv_transfer=KVTransfer(export=True)), self.prefill

    def second_leg(self, output: RequestOutput, source: int) -> EngineRequest | None:
        """The decode replica's request after the prefill replica's `output`."""
        request = self._waiting.pop(output.request_id, None)
        if request is None:
            return None
        # The prompt's logprobs came with the first leg's output.
        params = msgspec.structs.replace(request.sampling_params, prompt_logprobs=None)
        return msgspec.structs.replace(
            request,
            sampling_params=params,
            output_token_ids=list(output.new_token_ids),
            kv_transfer=KVTransfer(source=source),
        )

    def forget(self, request_id: str) -> None:
        """The request ended (or was stopped) before any handover."""
        self._waiting.pop(request_id, None)
