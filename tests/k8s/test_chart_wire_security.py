"""The chart's wire safety: the components that bind every interface of their pod say so
(--allow-remote-components), and `curveKeys.existingSecret` hands every component the CURVE
keys, read-only, where --curve-key-dir looks. Needs helm, as tests/k8s/test_chart.py does."""

from __future__ import annotations

import kubernetes_validate

from tests.k8s.test_chart import KUBERNETES_VERSION, by_kind, containers, environment, pods, render


def test_only_the_components_that_bind_every_interface_are_allowed_to() -> None:
    objects = render()
    for component, container in containers(objects).items():
        env = environment(objects, container)
        binds_all = any(value.startswith("tcp://0.0.0.0:") for value in env.values())
        assert (env.get("KVFLOW_ALLOW_REMOTE_COMPONENTS") == "1") == binds_all, component
        assert "KVFLOW_CURVE_KEY_DIR" not in env  # off unless a Secret is named
    assert all("curve" not in str(pod) for pod in pods(objects))


def test_a_curve_secret_reaches_every_component_read_only() -> None:
    objects = render("values.yaml", "curveKeys.existingSecret=kvflow-curve")
    for component, container in containers(objects).items():
        key_dir = environment(objects, container)["KVFLOW_CURVE_KEY_DIR"]
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == key_dir]
        assert mount["readOnly"], component
        pod = next(p for p in pods(objects) if container in p["spec"]["containers"])
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "kvflow-curve"
        assert volume["secret"]["defaultMode"] & 0o007 == 0  # other users of the node: nothing
    for deployment in by_kind(objects, "Deployment").values():
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
