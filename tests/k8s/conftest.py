"""Every chart test runs once under each major version of helm (tests/k8s/helm.py): without
that version it is skipped, unless KVFLOW_TEST_HELM=1 demands both, as CI does."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.k8s import helm


@pytest.fixture(params=helm.MAJORS, ids=[f"helm{major}" for major in helm.MAJORS], autouse=True)
def helm_binary(request: pytest.FixtureRequest) -> Iterator[str]:
    binary = helm.installed().get(request.param)
    if binary is None:
        why = f"no helm {request.param} (bash scripts/helm.sh {request.param} installs it)"
        if os.environ.get("KVFLOW_TEST_HELM") == "1":
            pytest.fail(f"KVFLOW_TEST_HELM=1 but {why}")
        pytest.skip(why)
    helm.use(binary)
    yield binary
    helm.use(None)
