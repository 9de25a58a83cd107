"""Embeddings (the `embed` sampling parameter): a prompt's final hidden states pooled into one
vector, chunk by chunk as its prompt is computed.

A prompt split across steps (chunked prefill) is pooled across them: the running sum of every
position for mean pooling, the first position's state for cls, the last one's for last-token
pooling; the vector is made by the step that computes the prompt's last token.

```
prompt:  [ chunk 1 (step k) | chunk 2 (step k+1) | chunk 3 (step k+2) ]
mean:      sum ───────────────▶ sum ──────────────▶ sum / n ─▶ vector
cls:       position 0 kept ─────────────────────────────────▶ vector
last:                                                position n-1 ─▶ vector
```
"""

from __future__ import annotations

import torch

from services.executor.runner.step_state import RequestState
from shared.pooling import PoolingConfig


def pool_chunk(
    config: PoolingConfig,
    hidden: torch.Tensor,  # [T, hidden], the step's, final-normed
    state: RequestState,
    first: int,
    start: int,
    count: int,
) -> torch.Tensor | None:
    """Fold a prompt chunk (positions start .. start + count - 1 at token indices first ..) into
    the request's pooled state; the finished vector [hidden] (float32) once the chunk ends the
    prompt, else None."""
    chunk = hidden[first : first + count].float()  # [count, hidden]
    if config.pooling_type == "mean":
        part = chunk.sum(dim=0)  # [hidden]
        state.pooled = part if state.pooled is None else state.pooled + part
    elif config.pooling_type == "cls" and start == 0:
        state.pooled = chunk[0].clone()  # [hidden]: the step's hidden buffer is reused
    num_prompt = len(state.prompt_token_ids)
    if start + count < num_prompt:
        return None
    if config.pooling_type == "last":
        # A copy: on a float32 model `chunk` is a view of the step's (reused) hidden states.
        vector = chunk[num_prompt - 1 - start].clone()  # [hidden]
    elif config.pooling_type == "mean":
        assert state.pooled is not None
        vector = state.pooled / num_prompt
    else:
        assert state.pooled is not None
        vector = state.pooled
    state.pooled = None
    if config.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector
