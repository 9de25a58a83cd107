"""/v1/messages as an Endpoint of the one generate flow: its body read as a chat completion,
its answers shaped by messages_output.py."""

from __future__ import annotations

import dataclasses

from services.frontend.api.endpoints import CallPlan, Endpoint, Inputs, read_chat
from services.frontend.api.messages_output import MessagesCall, MessagesStream, message_body
from services.frontend.api.messages_request import MessagesRequest, to_chat


def _read(body: MessagesRequest) -> Inputs:
    return dataclasses.replace(read_chat(to_chat(body)), context=MessagesCall())


def _call(plan: CallPlan) -> MessagesCall:
    call: MessagesCall = plan.context
    return call


MESSAGES = Endpoint(
    body_type=MessagesRequest,
    read=_read,
    logprobs_param="top_logprobs",
    id_prefix="msg",
    response_body=lambda plan, choices: message_body(_call(plan), plan.model, choices[0]),
    stream_writer=lambda plan: MessagesStream(_call(plan), plan.model),
)
