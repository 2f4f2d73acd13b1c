"""deploy/compose.yaml validates against the compose specification's JSON schema (the copy
check-jsonschema vendors as ``vendor.compose-spec``), and its services fit together: every mounted
file exists, the demo's config loads, the drains run as the least-privilege role after the
migration, and the demo's Prometheus config passes promtool.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from drain_adapters.rq import rules as rq_rules

from drain import config
from drain.backend import allowlist
from tests.conftest import need_binary
from tests.deploy import files

Object = dict[str, Any]
# A release, not a moving major: PostgreSQL's releases have two numbers (16.4), the others three.
PINNED_IMAGE = re.compile(r"^[\w./-]+:v?\d+\.\d+(\.\d+)?([-.][\w.-]+)?$")


@pytest.fixture(scope="module")
def compose() -> Object:
    loaded: Object = yaml.safe_load(files.COMPOSE.read_text())
    return loaded


def compose_schema() -> Object:
    text = (
        resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    schema: Object = json.loads(text)
    return schema


def test_the_file_validates_against_the_compose_spec(compose: Object) -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_the_schema_catches_a_misspelled_key(compose: Object) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["drain"]["depends_onn"] = broken["services"]["drain"].pop("depends_on")
    schema = compose_schema()
    assert list(jsonschema.validators.validator_for(schema)(schema).iter_errors(broken))


def test_the_check_jsonschema_command_agrees() -> None:
    command = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run(
        [str(command), "--builtin-schema", "vendor.compose-spec", str(files.COMPOSE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_mounted_file_and_the_build_context_exist(compose: Object) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (files.DEPLOY / source).exists(), f"{name}: {source}"
        if "build" in service:
            context = files.DEPLOY / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file()


def test_every_image_is_pinned(compose: Object) -> None:
    for name, service in compose["services"].items():
        assert PINNED_IMAGE.match(service["image"]), f"{name}: {service['image']}"


def test_the_demo_brings_up_every_part(compose: Object) -> None:
    services = compose["services"]
    assert {
        "postgres",
        "migrate",
        "drain",
        "redis",
        "rabbitmq",
        "worker",
        "producer",
        "prometheus",
        "grafana",
    } <= set(services)
    drain = services["drain"]
    assert drain["deploy"]["replicas"] == 2  # two drains sharing the lanes (the next test)
    assert drain["command"] == ["run"]
    assert drain["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert int(drain["stop_grace_period"].rstrip("s")) > 30
    # The image's HEALTHCHECK asks a drain's /healthz: the image's other uses switch it off.
    for name in ("migrate", "worker", "producer"):
        assert services[name]["image"] == drain["image"]
        assert services[name]["healthcheck"] == {"disable": True}, name
    assert "healthcheck" not in drain
    # At least once across a Redis restart needs the AOF with fsync always.
    assert "--appendfsync" in services["redis"]["command"]
    assert services["redis"]["command"][services["redis"]["command"].index("--appendfsync") + 1] == "always"


def test_the_drains_run_as_the_least_privilege_role(compose: Object) -> None:
    services = compose["services"]
    drain_dsn = services["drain"]["environment"]["DRAIN_DSN"]
    owner_dsn = services["migrate"]["environment"]["DRAIN_DSN"]
    assert drain_dsn.startswith("postgresql://drain:")
    assert owner_dsn.startswith(f"postgresql://{services['postgres']['environment']['POSTGRES_USER']}:")
    created = (files.DEPLOY / "demo" / "initdb.sql").read_text()
    assert "CREATE ROLE drain LOGIN" in created
    assert any(v.startswith("./database/drain-role.sql:") for v in services["migrate"]["volumes"])
    assert "drain-role.sql" in " ".join(services["migrate"]["entrypoint"])


def test_the_demo_config_loads_and_allows_the_producers_job(compose: Object) -> None:
    services = compose["services"]
    mounted = next(v for v in services["drain"]["volumes"] if v.endswith(":/etc/drain/drain.toml:ro"))
    path = files.DEPLOY / mounted.split(":")[0]
    settings = config.load(path, env=services["drain"]["environment"])
    (job_name,) = re.findall(r"drain stage (\S+)", " ".join(services["producer"]["entrypoint"]))
    patterns = settings.backends["default"].options["allowed_jobs"]
    matcher, problems = allowlist.Allowlist.parse(patterns)
    assert not problems
    assert not rq_rules.allowed_jobs_problems(patterns, wildcards=False), "exact names, as RQ needs"
    assert matcher.admits(job_name)
    # Both drains forward: they share the table's lanes, more lanes than drains.
    assert settings.lanes > services["drain"]["deploy"]["replicas"]
    # The worker imports that job from the mounted examples.
    module = job_name.rsplit(".", 1)[0]
    assert (files.ROOT / "examples" / f"{module}.py").is_file()


def test_the_demo_prometheus_config_and_rules_pass_promtool(compose: Object, tmp_path: Path) -> None:
    promtool = need_binary("promtool", "prometheus")
    for volume in compose["services"]["prometheus"]["volumes"]:
        source, target = volume.split(":")[:2]
        shutil.copy(files.DEPLOY / source, tmp_path / Path(target).name)
    done = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout + done.stderr


def test_grafana_finds_the_dashboard_where_its_provisioning_looks(compose: Object) -> None:
    volumes = compose["services"]["grafana"]["volumes"]
    provider = yaml.safe_load(
        (files.ROOT / "grafana" / "provisioning" / "dashboards" / "drain.yml").read_text()
    )
    folder = provider["providers"][0]["options"]["path"]
    assert any(
        v.split(":")[1].startswith(folder + "/") and v.split(":")[0].endswith("drain.json") for v in volumes
    )
