"""What every route shares, kept on the app (`app.state.frontend`) rather than in closures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from services.frontend.api.response_store import ResponseStore
from services.frontend.api.validation import Served
from services.frontend.engine.client import EngineClient
from services.frontend.metrics.prometheus import Metrics
from services.frontend.metrics.share import MetricsShare
from shared.config import Config


@dataclass
class FrontendState:
    config: Config
    engine: EngineClient
    model_name: str  # the one model served, as the API names it
    metrics: Metrics
    served: Served  # the model's name, limits and timeout, for plan_call
    api_keys: tuple[bytes, ...] = ()  # a bearer token must match one; none: no key needed
    draining: bool = False  # set on SIGTERM: new requests get 503, /ready too
    # the other frontends' request metrics, when several run side by side (--api-server-count)
    metrics_share: MetricsShare | None = None
    # finished /v1/responses responses kept for previous_response_id and GET (store: true)
    response_store: ResponseStore = field(default_factory=lambda: ResponseStore(0))

    def not_ready_reason(self) -> str | None:
        """Why new requests are not taken now (what /ready answers), or None."""
        failure = self.engine.failure_reason()
        return failure or ("draining" if self.draining else self.engine.unavailable_reason())

    @property
    def max_model_len(self) -> int | None:
        """The context length, once the scheduler has said it."""
        return self.engine.stats.max_model_len if self.engine.stats else None


def frontend_state(request: Request) -> FrontendState:
    """The app's shared objects, as a route or a dependency reaches them."""
    state: FrontendState = request.app.state.frontend
    return state


# A route parameter typed `AppState` receives the FrontendState.
AppState = Annotated[FrontendState, Depends(frontend_state)]
