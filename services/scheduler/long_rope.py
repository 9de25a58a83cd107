"""LongRoPE (Phi-3's long-context models) in the scheduler: a request longer than the model's
original context is computed with the long set of frequencies from its start, as transformers
computes it (services/executor/layers/rotary.py).

A request that grows past the original context while running was computed with the short
set: the plan that would compute its first position past it requeues it instead, and it is
computed again from its start with the long set (its blocks then keyed apart from the short
set's, `Request.use_long_rope`), once its tokens in flight are in. A prompt past the original
context takes the long set from its admission.
"""

from __future__ import annotations

from services.scheduler.request import Request


def crosses_original_context(request: Request, original: int | None) -> bool:
    """Whether the request, with its tokens in flight, is longer than the original context
    while its KV is the short set's (`original` None: not a LongRoPE model)."""
    return (
        original is not None
        and not request.long_rope
        and request.num_scheduled_tokens_end > original
    )


def settle_long_rope(request: Request, original: int | None) -> None:
    """At admission: the long set from its start where it is longer than the original context.
    A prompt within it was computed with the short set on a prefill replica: not fetched."""
    if not crosses_original_context(request, original):
        return
    request.use_long_rope()
    if original is not None and request.num_prompt_tokens <= original:
        request.kv_source = -1
