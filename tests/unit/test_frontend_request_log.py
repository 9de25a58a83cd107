"""--enable-log-requests: the line logged when an API request ends."""

from __future__ import annotations

from services.frontend.metrics.request_log import RequestRecord, log_line


def test_a_generate_request_line() -> None:
    record = RequestRecord(request_id="cmpl-1", num_prompt_tokens=12, num_completion_tokens=30)
    assert log_line("POST", "/v1/completions", 200, record, 1.23456) == (
        "POST /v1/completions request_id=cmpl-1 status=200 prompt_tokens=12 "
        "completion_tokens=30 duration=1.235s"
    )


def test_a_request_without_id_or_response() -> None:
    assert log_line("GET", "/v1/models", None, RequestRecord(), 0.0004) == (
        "GET /v1/models request_id=- status=- prompt_tokens=0 completion_tokens=0 duration=0.000s"
    )
