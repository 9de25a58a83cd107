"""The Helm chart (k8s/kvflow): it lints, every values file renders objects that pass the
Kubernetes schemas strictly, and the rendered objects agree with kvflow itself: its
components and flags, the image's user, the compose file's ports, the drain timeout.

No cluster runs here. Every test runs under Helm 3 and under Helm 4 (`bash scripts/helm.sh 3`
and `4` install them); without one its tests are skipped, unless KVFLOW_TEST_HELM=1 demands
both, as CI does.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.executor.runner.kv_exports import bind_address
from services.executor.runner.kv_handover import rank_address
from shared.config import ENV_PREFIX, config_from_args
from tests.k8s import helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "kvflow"
VALUES = sorted(p.name for p in CHART.glob("values*.yaml"))
KUBERNETES_VERSION = "1.37.0"
COMPONENTS = {"frontend", "tokenizer", "scheduler", "executor"}
Obj = dict[str, Any]


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    """The test's helm: each test runs under Helm 3 and Helm 4 (tests/k8s/conftest.py)."""
    return subprocess.run([helm.current(), *args], capture_output=True, text=True, timeout=120)


def render(values: str = "values.yaml", *sets: str) -> list[Obj]:
    flags = [arg for s in sets for arg in ("--set", s)]
    result = run_helm("template", "kvflow", str(CHART), "-f", str(CHART / values), *flags)
    assert result.returncode == 0, result.stderr
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def by_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pods(objects: list[Obj]) -> Iterator[Obj]:
    for kind in ("Deployment", "StatefulSet"):
        for workload in by_kind(objects, kind).values():
            yield workload["spec"]["template"]


def containers(objects: list[Obj]) -> dict[str, Obj]:
    """Every container by its kvflow component (its first argument)."""
    found = {c["args"][0]: c for pod in pods(objects) for c in pod["spec"]["containers"]}
    assert set(found) == COMPONENTS
    return found


def environment(objects: list[Obj], container: Obj) -> dict[str, str]:
    """What the container's process sees: its ConfigMaps, then its own env (a Secret's value
    stands in as "secret")."""
    maps = by_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "secret")
    return env


@pytest.mark.parametrize("values", VALUES)
def test_the_chart_lints_strictly(values: str) -> None:
    result = run_helm("lint", "--strict", str(CHART), "-f", str(CHART / values))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_charts_own_defaults_render_and_lint() -> None:
    """No values file: the chart's own values.yaml, which Helm 3.18.0 reads with numbers as
    json.Number strings (a 0 among them is true to `if`), renders what the same file renders
    when given with -f, whose numbers every helm reads as numbers."""
    result = run_helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_helm("template", "kvflow", str(CHART))
    assert result.returncode == 0, result.stderr
    assert [obj for obj in yaml.safe_load_all(result.stdout) if obj] == render()


@pytest.mark.parametrize("values", VALUES)
def test_every_object_passes_the_kubernetes_schema_strictly(values: str) -> None:
    objects = render(values, "apiKey.value=sk-test")
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema offline (its shape is checked below)
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert {"Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy"} <= {
        o["kind"] for o in objects
    }


@pytest.mark.parametrize("values", VALUES)
def test_every_component_gets_settings_kvflow_accepts(values: str, monkeypatch) -> None:
    """Every KVFLOW_ variable names a real flag and parses as kvflow parses it."""
    objects = render(values, "apiKey.value=sk-test")
    for component, container in containers(objects).items():
        env = environment(objects, container)
        for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        config = config_from_args(argparse.Namespace())
        known = {ENV_PREFIX + name.upper() for name in vars(config)}
        assert set(env) <= known, f"{component}: unknown {sorted(set(env) - known)}"
        assert config.drain_timeout > 0


def assert_address_meets_its_binder(
    objects: list[Obj], address: str, binder: str, port_name: str, replica: int = 0
) -> None:
    """A connecting component's `address` reaches the port `binder` binds: by a Service's name,
    or (an engine pod) by the pod's name under the StatefulSet's headless Service."""
    services, found = by_kind(objects, "Service"), containers(objects)
    host, port = re.fullmatch(r"tcp://([\w.-]+):(\d+)", address).groups()
    pod_name, _, service_name = host.rpartition(".")
    service = services[service_name or pod_name]
    if pod_name and service_name:
        [engine] = by_kind(objects, "StatefulSet").values()
        assert engine["spec"]["serviceName"] == service_name
        assert service["spec"]["clusterIP"] == "None"  # the pods' own names resolve
        assert pod_name == f"{engine['metadata']['name']}-{replica}"
    ports = {p["targetPort"]: p["port"] for p in service["spec"]["ports"]}
    assert ports[port_name] == int(port)
    assert service["spec"]["publishNotReadyAddresses"]  # reachable while /ready is 503
    assert {"name": port_name, "containerPort": int(port)} in found[binder]["ports"]
    pod = next(p for p in pods(objects) if found[binder] in p["spec"]["containers"])
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_the_addresses_meet_the_services_and_ports() -> None:
    objects = render()
    found = containers(objects)
    tokenizer_env = environment(objects, found["tokenizer"])
    for address_var, binder, port_name in [
        ("KVFLOW_FRONTEND_ADDRESS", "frontend", "zmq-frontend"),
        ("KVFLOW_SCHEDULER_ADDRESS", "scheduler", "zmq-scheduler"),
    ]:
        assert_address_meets_its_binder(objects, tokenizer_env[address_var], binder, port_name)
        port = tokenizer_env[address_var].rpartition(":")[2]
        assert environment(objects, found[binder])[address_var] == f"tcp://0.0.0.0:{port}"
    executor = environment(objects, found["executor"])["KVFLOW_SCHEDULER_ADDRESS"]
    assert executor.startswith("tcp://127.0.0.1:")  # beside its scheduler, in the engine pod
    assert "KVFLOW_KV_EVENTS_ADDRESS" not in tokenizer_env  # one engine: nothing to route


def test_engine_replicas_are_pods_each_reached_by_name_with_its_own_rank(monkeypatch) -> None:
    """flags.data-parallel-size 3: three engine pods; every tokenizer worker connects to each
    pod's scheduler and KV events by the pod's name, and pod R binds replica R's entries."""
    objects = render("values-gpu.yaml", "flags.data-parallel-size=3")
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    [engine] = by_kind(objects, "StatefulSet").values()
    assert engine["spec"]["replicas"] == 3
    assert engine["spec"]["podManagementPolicy"] == "Parallel"
    found = containers(objects)
    tokenizer_env = environment(objects, found["tokenizer"])
    for variable, port_name in [
        ("KVFLOW_SCHEDULER_ADDRESS", "zmq-scheduler"),
        ("KVFLOW_KV_EVENTS_ADDRESS", "zmq-kv-events"),
    ]:
        addresses = tokenizer_env[variable].split(",")
        assert len(addresses) == 3
        for replica, address in enumerate(addresses):
            assert_address_meets_its_binder(objects, address, "scheduler", port_name, replica)
    for component in ("scheduler", "executor"):
        rank = {v["name"]: v for v in found[component]["env"]}["KVFLOW_DATA_PARALLEL_RANK"]
        label = rank["valueFrom"]["fieldRef"]["fieldPath"]
        assert label == "metadata.labels['apps.kubernetes.io/pod-index']"
        # What kvflow reads in pod 2: replica 2's entries, its own pod's ports.
        for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(name)
        env = environment(objects, found[component])
        for name, value in {**env, "KVFLOW_DATA_PARALLEL_RANK": "2"}.items():
            monkeypatch.setenv(name, value)
        config = config_from_args(argparse.Namespace())
        assert (config.data_parallel_size, config.replica) == (3, 2)
        host = "0.0.0.0" if component == "scheduler" else "127.0.0.1"
        assert config.replica_address("scheduler_address") == f"tcp://{host}:5558"
    policy = by_kind(objects, "NetworkPolicy")["kvflow-engine"]["spec"]["ingress"][0]
    assert {p["port"] for p in policy["ports"]} == {5558, 5559}
    for how, bad in [
        ("--set-string", "0"),
        ("--set-string", "08"),
        ("--set-string", "two"),
        ("--set", "0"),
    ]:
        # refused, not read as 1 (a 0 is no unset flag), octal 0 or nothing
        result = run_helm("template", "kvflow", str(CHART), how, f"flags.data-parallel-size={bad}")
        assert result.returncode != 0 and "whole number >= 1" in result.stderr, (how, bad)


def test_prefill_pods_hand_kv_over_to_decode_pods_by_name(monkeypatch) -> None:
    """flags.prefill-replicas 1 of 3 at tensor-parallel size 2: every executor knows each
    pod's KV transfer address by the pod's name; pod 0 prefills and binds its ports (one a
    rank) on every interface, which the policy opens to the release's pods alone."""
    sets = ("flags.data-parallel-size=3", "flags.prefill-replicas=1")
    objects = render(
        "values-gpu.yaml", *sets, "flags.tensor-parallel-size=2", "engine.executor.gpus=2"
    )
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    executor = containers(objects)["executor"]
    assert [p["containerPort"] for p in executor["ports"]] == [5560, 5561]
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in {**environment(objects, executor), "KVFLOW_DATA_PARALLEL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    config = config_from_args(argparse.Namespace())
    assert (config.prefill_replicas, config.replica) == (1, 0)
    addresses = config.addresses("kv_transfer_address")
    assert addresses == [f"tcp://kvflow-engine-{r}.kvflow-engine:5560" for r in range(3)]
    assert bind_address(rank_address(addresses[0], 1)) == "tcp://0.0.0.0:5561"
    policy = by_kind(objects, "NetworkPolicy")["kvflow-engine"]["spec"]["ingress"][0]
    assert {p["port"] for p in policy["ports"]} == {5558, 5559, 5560, 5561}
    plain = containers(render("values-gpu.yaml", "flags.data-parallel-size=2"))["executor"]
    assert "ports" not in plain and "KVFLOW_KV_TRANSFER_ADDRESS" not in str(plain)


def test_the_api_port_is_the_compose_files() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    published = compose["services"]["frontend"]["ports"][0].rsplit(":", 1)[1]
    objects = render()
    frontend = containers(objects)["frontend"]
    assert {"name": "http", "containerPort": int(published)} in frontend["ports"]
    assert environment(objects, frontend)["KVFLOW_PORT"] == published
    [api] = [
        s for s in by_kind(objects, "Service").values() if s["spec"]["ports"][0]["name"] == "http"
    ]
    assert api["spec"]["ports"][0]["targetPort"] == "http"


def test_probes_and_drain_fit_the_frontend() -> None:
    objects = render()
    frontend = containers(objects)["frontend"]
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert frontend["readinessProbe"]["failureThreshold"] == 1  # out of the Service at once
    assert frontend["livenessProbe"]["tcpSocket"] == {"port": "http"}  # not /health: a dead
    # engine is not cured by restarting the frontend
    startup = frontend["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    drain = float(environment(objects, frontend)["KVFLOW_DRAIN_TIMEOUT"])
    pre_stop = frontend["lifecycle"]["preStop"]["sleep"]["seconds"]
    pod = next(p for p in pods(objects) if frontend in p["spec"]["containers"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain
    tokenizer = containers(objects)["tokenizer"]  # drains its own requests on SIGTERM too
    pod = next(p for p in pods(objects) if tokenizer in p["spec"]["containers"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert int(compose["services"]["frontend"]["stop_grace_period"].rstrip("s")) > drain


def test_every_pod_runs_as_the_images_user_with_a_read_only_root() -> None:
    uid = int(re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))
    objects = render("values-gpu.yaml")
    for pod in pods(objects):
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] == uid
        writable = {v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v}
        for container in pod["spec"]["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and context["capabilities"] == {
                "drop": ["ALL"]
            }
            assert not context["allowPrivilegeEscalation"]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            for path in ("/tmp", "/home/kvflow"):
                assert mounts[path]["name"] in writable
            assert mounts["/models"]["readOnly"]


def test_the_gpu_values_give_the_executor_alone_a_gpu_and_shared_memory() -> None:
    objects = render("values-gpu.yaml")
    found = containers(objects)
    for component, container in found.items():
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (1 if component == "executor" else None), component
    engine = by_kind(objects, "StatefulSet")["kvflow-engine"]["spec"]
    # One pod at a time, the old one gone first: the new pod needs the old one's GPU.
    assert engine["updateStrategy"] == {"type": "RollingUpdate"}
    shm = {v["name"]: v for v in engine["template"]["spec"]["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in found["executor"]["volumeMounts"]
    assert not any("nvidia.com/gpu" in str(c) for c in render("values-cpu.yaml"))
    executor = containers(render("values-gpu.yaml", "engine.executor.gpus=0"))["executor"]
    assert "nvidia.com/gpu" not in executor["resources"]["limits"]


def test_tensor_parallel_ranks_get_a_gpu_each(tmp_path: Path) -> None:
    ranks = "flags.tensor-parallel-size=2"
    objects = render("values-gpu.yaml", ranks, "engine.executor.gpus=2")
    executor = containers(objects)["executor"]
    assert executor["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert environment(objects, executor)["KVFLOW_TENSOR_PARALLEL_SIZE"] == "2"
    args = ["template", "kvflow", str(CHART), "-f", str(CHART / "values-gpu.yaml")]
    result = run_helm(*args, "--set", ranks)
    assert result.returncode != 0 and "needs engine.executor.gpus: 2" in result.stderr
    # The same asked for in a values file (a number there, not --set's).
    (tmp_path / "ranks.yaml").write_text("flags: {tensor-parallel-size: 2}\n")
    result = run_helm(*args, "-f", str(tmp_path / "ranks.yaml"))
    assert result.returncode != 0 and "needs engine.executor.gpus: 2" in result.stderr
    # No GPU asked for (the default values' gpus: 0): any number of ranks, no GPU limit.
    objects = render("values.yaml", ranks)
    executor = containers(objects)["executor"]
    assert environment(objects, executor)["KVFLOW_TENSOR_PARALLEL_SIZE"] == "2"
    assert "nvidia.com/gpu" not in str(executor["resources"])


def test_autoscalers_scale_the_frontends_and_the_tokenizer_pool() -> None:
    objects = render("values-gpu.yaml")
    deployments = by_kind(objects, "Deployment")
    hpas = by_kind(objects, "HorizontalPodAutoscaler").values()
    targets = {}
    for hpa in hpas:
        target = deployments[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"]  # the HPA owns it
        assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
        targets[target["spec"]["template"]["spec"]["containers"][0]["args"][0]] = target
    assert set(targets) == {"frontend", "tokenizer"}  # never the engine: it holds the GPU
    strategy = targets["frontend"]["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0  # a new one is ready first
    for pdb in by_kind(objects, "PodDisruptionBudget").values():
        selected = [
            d
            for d in targets.values()
            if pdb["spec"]["selector"]["matchLabels"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1 and pdb["spec"]["maxUnavailable"] == 1
    assert len(by_kind(objects, "PodDisruptionBudget")) == 2


def test_tokenizer_workers_roll_without_emptying_the_pool() -> None:
    """A new worker is ready (its file made once it takes requests) before an old one drains."""
    objects = render()
    tokenizer = containers(objects)["tokenizer"]
    ready_file = environment(objects, tokenizer)["KVFLOW_READY_FILE"]
    assert tokenizer["readinessProbe"]["exec"]["command"] == ["test", "-f", ready_file]
    assert ready_file.startswith("/tmp/")  # an emptyDir: writable under the read-only root
    deployment = next(
        d
        for d in by_kind(objects, "Deployment").values()
        if tokenizer in d["spec"]["template"]["spec"]["containers"]
    )
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert deployment["spec"]["minReadySeconds"] >= 1


def test_a_chart_upgrade_alone_restarts_no_pod() -> None:
    """Pod templates carry no chart or app version: only a real change rolls them."""
    for pod in pods(render()):
        labels = pod["metadata"]["labels"]
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels


def test_extra_autoscaling_metrics_pass_through_valid() -> None:
    metric = "frontend.autoscaling.extraMetrics[0]"
    objects = render(
        "values-gpu.yaml",
        f"{metric}.type=Pods",
        f"{metric}.pods.metric.name=kvflow_frontend_requests_in_flight",
        f"{metric}.pods.target.type=AverageValue",
        f"{metric}.pods.target.averageValue=8",
    )
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["kvflow-frontend"]
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
    assert hpa["spec"]["metrics"][1]["pods"]["metric"]["name"] == (
        "kvflow_frontend_requests_in_flight"
    )


def test_the_frontends_zeromq_name_resolves_to_every_frontend() -> None:
    """Headless: each component links to every frontend pod, ready or not."""
    objects = render("values-gpu.yaml")
    zmq_service = next(
        s
        for s in by_kind(objects, "Service").values()
        if s["spec"]["ports"][0]["name"] == "zmq-frontend"
    )
    assert zmq_service["spec"]["clusterIP"] == "None"
    assert zmq_service["spec"]["publishNotReadyAddresses"]


def test_the_api_key_comes_from_a_secret_only() -> None:
    objects = render("values.yaml", "apiKey.value=sk-very-secret")
    [secret] = by_kind(objects, "Secret").values()
    assert base64.b64decode(secret["data"]["api-key"]) == b"sk-very-secret"
    others = [o for o in objects if o["kind"] != "Secret"]
    assert "sk-very-secret" not in yaml.safe_dump_all(others)
    [key] = [v for v in containers(objects)["frontend"]["env"] if v["name"] == "KVFLOW_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "api-key",
    }
    existing = render("values.yaml", "apiKey.existingSecret=mine")
    assert not by_kind(existing, "Secret")
    [key] = [v for v in containers(existing)["frontend"]["env"] if v["name"] == "KVFLOW_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["name"] == "mine"
    assert all(v["name"] != "KVFLOW_API_KEY" for v in containers(render())["frontend"]["env"])


def test_only_the_releases_pods_reach_the_zeromq_ports() -> None:
    objects = render()
    policies = by_kind(objects, "NetworkPolicy")
    labels = [pod["metadata"]["labels"] for pod in pods(objects)]
    zmq_ports = {5557, 5558}
    for policy in policies.values():
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if ports & zmq_ports:
                [peer] = rule["from"]
                selector = peer["podSelector"]["matchLabels"]
                assert selector["app.kubernetes.io/instance"] == "kvflow"
                assert all(selector.items() <= pod_labels.items() for pod_labels in labels)
    tokenizer = next(p for n, p in policies.items() if n.endswith("-tokenizer"))
    assert tokenizer["spec"]["ingress"] == []
    api = render("values.yaml", "networkPolicy.apiFrom[0].namespaceSelector.matchLabels.team=ml")
    frontend = next(p for n, p in by_kind(api, "NetworkPolicy").items() if n.endswith("-frontend"))
    http_rule = frontend["spec"]["ingress"][0]
    assert http_rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]


def test_the_service_monitor_scrapes_the_api_services_metrics() -> None:
    objects = render("values-gpu.yaml", "apiKey.value=sk-x", "serviceMonitor.enabled=true")
    [monitor] = [o for o in objects if o["kind"] == "ServiceMonitor"]
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert endpoint["authorization"]["credentials"]["key"] == "api-key"  # /metrics needs the key
    api = by_kind(objects, "Service")["kvflow"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= api["metadata"]["labels"].items()
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]  # off unless asked


def test_flag_values_render_exactly() -> None:
    """Large integers must not turn into floats on their way through helm."""
    objects = render("values.yaml", "flags.max-num-batched-tokens=16777216")
    [config] = by_kind(objects, "ConfigMap").values()
    assert config["data"]["KVFLOW_MAX_NUM_BATCHED_TOKENS"] == "16777216"


def test_a_model_volume_needs_a_source() -> None:
    result = run_helm("template", "kvflow", str(CHART), "--set", "modelVolume.enabled=true")
    assert result.returncode != 0 and "existingClaim or modelVolume.hostPath" in result.stderr
