"""The API's routes, one router per concern; create_app mounts them behind their guards."""

from __future__ import annotations

import uuid


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
