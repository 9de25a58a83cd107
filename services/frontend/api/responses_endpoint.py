"""/v1/responses as an Endpoint of the one generate flow: its body read as a chat completion
(after the stored conversation it continues), its answers shaped by responses_output.py."""

from __future__ import annotations

import dataclasses

from services.frontend.api.endpoints import CallPlan, Endpoint, Inputs, read_chat
from services.frontend.api.errors import APIError
from services.frontend.api.response_store import ResponseStore
from services.frontend.api.responses_output import ResponsesCall, ResponsesStream, finished_response
from services.frontend.api.responses_request import ResponsesRequest, to_chat


def responses_endpoint(store: ResponseStore) -> Endpoint[ResponsesRequest]:
    """The endpoint of one call, reading and keeping conversations in `store`."""

    def read(body: ResponsesRequest) -> Inputs:
        earlier = []
        if body.previous_response_id is not None:
            found = store.conversation(body.previous_response_id)
            if found is None:
                raise response_not_found(body.previous_response_id, "previous_response_id")
            earlier = found
        inputs = read_chat(to_chat(body, earlier))
        return dataclasses.replace(inputs, context=ResponsesCall(body, on_finished=store.put))

    return Endpoint(
        body_type=ResponsesRequest,
        read=read,
        logprobs_param="top_logprobs",
        id_prefix="resp",
        response_body=lambda plan, choices: finished_response(
            _call(plan), plan.model, choices[0], None
        ),
        stream_writer=lambda plan: ResponsesStream(_call(plan), plan.model),
    )


def _call(plan: CallPlan) -> ResponsesCall:
    call: ResponsesCall = plan.context
    return call


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        "invalid_request_error",
        param,
        "response_not_found",
    )
