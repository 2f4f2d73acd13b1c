"""deploy/kubernetes renders (tests/deploy/kustomize.py, checked against ``kubectl kustomize`` when it
is installed), every object validates against the Kubernetes schemas, and the objects agree with
each other, with the image and with the drain: probes, ports, names, labels, secrets, config.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from drain import config
from drain.store import reading
from tests.conftest import need_binary
from tests.deploy import dockerfile, files, kustomize

# The newest schemas kubernetes-validate ships, and the oldest Kubernetes the manifests promise.
KUBERNETES_VERSIONS = ("1.37.0", "1.29.0")
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
Object = dict[str, Any]


def by_kind(objects: list[Object]) -> dict[str, Object]:
    found: dict[str, Object] = {}
    for obj in objects:
        assert obj["kind"] not in found, f"two {obj['kind']}s: the tests below assume one"
        found[obj["kind"]] = obj
    return found


@pytest.fixture(scope="module")
def base() -> dict[str, Object]:
    return by_kind(kustomize.render(files.BASE))


@pytest.fixture(scope="module")
def monitored() -> dict[str, Object]:
    return by_kind(kustomize.render(files.WITH_MONITORING))


def test_the_base_renders_the_objects_of_one_drain_deployment(base: dict[str, Object]) -> None:
    assert set(base) == {
        "ServiceAccount",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "Job",
        "ConfigMap",
        "Secret",
    }
    # Generated names carry kustomize's content hash, so a changed config rolls the pods.
    assert base["ConfigMap"]["metadata"]["name"].startswith("drain-config-")
    assert base["Secret"]["metadata"]["name"].startswith("drain-secrets-")


def test_the_monitoring_component_adds_exactly_the_operator_objects(
    base: dict[str, Object], monitored: dict[str, Object]
) -> None:
    assert set(monitored) - set(base) == CUSTOM_KINDS
    assert all(monitored[kind] == base[kind] for kind in base)


@pytest.mark.parametrize("folder", [files.BASE, files.WITH_MONITORING], ids=["base", "with-monitoring"])
def test_the_renderer_agrees_with_kubectl_kustomize(folder: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # not a Debian package: nothing CI could install, so a plain skip
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True)
    theirs = [obj for obj in yaml.safe_load_all(out.stdout) if obj]

    def key(obj: Object) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    assert sorted(kustomize.render(folder), key=key) == sorted(theirs, key=key)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
    monitored: dict[str, Object], version: str
) -> None:
    for kind, obj in monitored.items():
        if kind in CUSTOM_KINDS:
            continue  # no schema ships for a CRD: checked by the tests below
        # strict: an unknown or misspelled field is an error, not silently dropped by the API server
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_misspelled_field_fails_validation(base: dict[str, Object]) -> None:
    broken = yaml.safe_load(yaml.safe_dump(base["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def container(obj: Object) -> Object:
    (found,) = obj["spec"]["template"]["spec"]["containers"]
    result: Object = found
    return result


def test_the_deployment_keeps_its_drains_and_probes_the_drains_endpoints(base: dict[str, Object]) -> None:
    deployment = base["Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] >= 3
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    drain = container(deployment)
    assert drain["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # Readiness is /readyz (the database answers), never leadership: the standby is Ready.
    assert drain["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert drain["args"][0] == "run"
    assert {"cpu", "memory"} <= set(drain["resources"]["requests"])
    assert "memory" in drain["resources"]["limits"]
    # The grace period must outlast the batch SIGTERM lets finish (publish timeout, statement_timeout 30 s).
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > 30


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_pods_run_as_the_images_user_read_only_and_without_privileges(
    base: dict[str, Object], kind: str
) -> None:
    pod = base[kind]["spec"]["template"]["spec"]
    uid, gid = dockerfile.final_user(dockerfile.parse(files.DOCKERFILE.read_text()))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    security = container(base[kind])["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]


def test_selectors_and_ports_line_up(monitored: dict[str, Object]) -> None:
    pod_labels = monitored["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selector = monitored["Deployment"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert monitored["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # one drain at a time, whatever the replicas: the others take its lanes
    assert monitored["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1,
        "selector": monitored["PodDisruptionBudget"]["spec"]["selector"],
    }
    service = monitored["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    (container_port,) = container(monitored["Deployment"])["ports"]
    assert port["targetPort"] == container_port["name"] == "metrics"
    assert container_port["containerPort"] in dockerfile.exposed(
        dockerfile.parse(files.DOCKERFILE.read_text())
    )
    monitor = monitored["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [endpoint["port"] for endpoint in monitor["endpoints"]] == [port["name"]]
    # The operator names the job after the Service; DrainDown watches up{job="drain"}.
    assert service["metadata"]["name"] == "drain"
    assert 'up{job="drain"}' in files.RULES.read_text()


def test_the_config_and_secret_names_resolve_and_the_config_loads(base: dict[str, Object]) -> None:
    config_map, secret = base["ConfigMap"], base["Secret"]
    for kind in ("Deployment", "Job"):
        pod = base[kind]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "configMap" in v]
        assert volume["configMap"]["name"] == config_map["metadata"]["name"]
        mount = next(m for m in container(base[kind])["volumeMounts"] if m["name"] == volume["name"])
        args = container(base[kind])["args"]
        assert args[args.index("--config") + 1] == f"{mount['mountPath']}/drain.toml"
        for variable in container(base[kind]).get("env", []):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"]
                assert ref["key"] in secret["data"]
    (source,) = container(base["Deployment"])["envFrom"]
    assert source["secretRef"]["name"] == secret["metadata"]["name"]
    # The config in the ConfigMap loads with the Secret's variables, as the drain will load it.
    env = files.env_file((files.BASE / "secrets.env").read_text())
    path = files.BASE / "drain.toml"
    assert config_map["data"]["drain.toml"] == path.read_text()
    settings = config.load(path, env=env)
    assert set(settings.backends) == {"default"}


def test_the_replicas_share_the_lanes(base: dict[str, Object]) -> None:
    """Several replicas forward the table together: the ConfigMap's drain.toml sets lanes, at
    least one for each drain a rollout runs at once (replicas + maxSurge), so that the extra pod
    leads lanes too and a drain joining or leaving moves a fraction of the load
    (docs/operations/scaling.md, Sizing)."""
    env = files.env_file((files.BASE / "secrets.env").read_text())
    settings = config.load(files.BASE / "drain.toml", env=env)
    spec = base["Deployment"]["spec"]
    at_once = spec["replicas"] + spec["strategy"]["rollingUpdate"]["maxSurge"]
    assert at_once <= settings.lanes <= config.MAX_LANES


QUANTITY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (``256Mi``) in bytes."""
    for suffix, factor in QUANTITY_UNITS.items():
        if text.endswith(suffix):
            return int(text.removesuffix(suffix)) * factor
    return int(text)


def test_the_memory_limit_and_request_follow_from_the_readmes_bound(base: dict[str, Object]) -> None:
    """limit >= base + 2.5 x batch_max_bytes of the ConfigMap's drain.toml; request >= base."""
    env = files.env_file((files.BASE / "secrets.env").read_text())
    settings = config.load(files.BASE / "drain.toml", env=env)
    resources = container(base["Deployment"])["resources"]
    limit = quantity_bytes(resources["limits"]["memory"])
    request = quantity_bytes(resources["requests"]["memory"])
    assert limit >= reading.memory_bound_bytes(settings.batch_max_bytes), (limit, settings.batch_max_bytes)
    assert reading.BASE_RSS_BYTES <= request <= limit


def test_the_migrate_job_runs_as_the_owner_and_the_drain_as_its_own_role(base: dict[str, Object]) -> None:
    job = container(base["Job"])
    assert job["args"][0] == "migrate"
    dsn = next(v for v in job["env"] if v["name"] == "DRAIN_DSN")
    assert dsn["valueFrom"]["secretKeyRef"]["key"] == "MIGRATE_DSN"
    env = files.env_file((files.BASE / "secrets.env").read_text())
    assert env["DRAIN_DSN"] != env["MIGRATE_DSN"]


def test_the_prometheus_rule_is_generated_from_the_alert_rules_file() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", files.MONITORING / "generate.py")
    assert spec and spec.loader
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    expected = generate.render(files.RULES.read_text())
    assert (files.MONITORING / "prometheusrule.yaml").read_text() == expected, (
        "prometheusrule.yaml is stale: run deploy/kubernetes/components/monitoring/generate.py"
    )


def test_the_prometheus_rules_groups_pass_promtool(monitored: dict[str, Object], tmp_path: Path) -> None:
    promtool = need_binary("promtool", "prometheus")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(monitored["PrometheusRule"]["spec"]))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
