"""docker-compose.yml, its GPU override, the Collector config and the Dockerfile, checked without Docker:
validity against the Compose Specification schema, and the deployment's invariants."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.deploy.compose_file import (
    CDB_SERVICES,
    COLLECTOR,
    GPU_OVERRIDE,
    ROOT,
    SCHEMA,
    STAGES,
    command_argv,
    flag_values,
    interpolate,
    interpolate_str,
    load,
    merge,
)

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is needed to validate the compose file")

SCHEDULER_CMD = (
    "python -m cdb scheduler --listen 0.0.0.0:50051 --stage prelude=127.0.0.1:50061 "
    "--stage loop=127.0.0.1:50062 --stage head=127.0.0.1:50063 --model ${CDB_MODEL:-ouro-tiny}"
)
STAGE_CMD = "python -m cdb stage --role {role} --listen 127.0.0.1:{port} --model ${{CDB_MODEL:-ouro-tiny}}"
STAGE_PORTS = {"prelude": 50061, "loop": 50062, "head": 50063}


def _errors(doc: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return interpolate(compose, {})["services"]


def test_schema_is_the_compose_spec() -> None:
    schema = json.loads(SCHEMA.read_text())
    assert schema["title"] == "Compose Specification"
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("env", [{}, {"CDB_MODEL": "/models/ouro-1.4b", "CDB_PORT": "6000", "CDB_SHM_SIZE": "4gb"}])
def test_compose_file_is_valid(compose: dict[str, Any], env: dict[str, str]) -> None:
    assert _errors(compose) == []
    assert _errors(interpolate(compose, env)) == []


def test_gpu_override_is_valid(compose: dict[str, Any]) -> None:
    override = load(GPU_OVERRIDE)
    assert _errors(override) == []
    assert _errors(interpolate(merge(compose, override), {})) == []


def test_validation_catches_mistakes(compose: dict[str, Any]) -> None:
    """The schema really constrains: an unknown key, a wrong type."""
    bad = merge(compose, {"services": {"loop": {"netwrok_mode": "host"}}})
    assert any("netwrok_mode" in e for e in _errors(bad))
    bad = merge(compose, {"services": {"scheduler": {"ipc": ["shareable"]}}})
    assert any(e.startswith("services/scheduler/ipc") for e in _errors(bad))


def test_interpolation() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate_str("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $SET $$SET", env) == "v d d  v $SET"
    assert interpolate_str("${SET:+alt}|${UNSET:+alt}", env) == "alt|"
    with pytest.raises(ValueError, match="UNSET"):
        interpolate_str("${UNSET:?needed}", env)


def test_services_and_commands(compose: dict[str, Any]) -> None:
    raw = compose["services"]
    assert set(raw) == {*CDB_SERVICES, "otel-collector", "jaeger"}
    assert raw["scheduler"]["command"] == SCHEDULER_CMD
    for role, port in STAGE_PORTS.items():
        assert raw[role]["command"] == STAGE_CMD.format(role=role, port=port)
    images = {raw[name]["image"] for name in CDB_SERVICES}
    assert len(images) == 1, "the scheduler and the stages run one image"
    assert all(raw[name]["build"]["context"] == "." for name in CDB_SERVICES)


def test_commands_wire_the_stages_together(services: dict[str, Any]) -> None:
    sched = command_argv(services["scheduler"])
    assert sched[:4] == ["python", "-m", "cdb", "scheduler"]
    assert flag_values(sched, "--listen") == ["0.0.0.0:50051"]
    stage_addrs = dict(spec.split("=", 1) for spec in flag_values(sched, "--stage"))
    for role in STAGES:
        argv = command_argv(services[role])
        assert argv[:4] == ["python", "-m", "cdb", "stage"]
        assert flag_values(argv, "--role") == [role]
        (listen,) = flag_values(argv, "--listen")
        assert listen.startswith("127.0.0.1:"), "stage endpoints stay on loopback"
        assert stage_addrs[role] == listen
        assert flag_values(argv, "--model") == flag_values(sched, "--model") == ["ouro-tiny"]


def test_only_the_scheduler_publishes_ports(services: dict[str, Any]) -> None:
    for name in (*STAGES, "otel-collector"):
        assert "ports" not in services[name], name
    published = {}
    for spec in services["scheduler"]["ports"]:
        host_ip, _, container_port = spec.rsplit(":", 2)
        published[int(container_port)] = host_ip
    assert published == {50051: "0.0.0.0", 9464: "127.0.0.1"}, "public API, and metrics on the host only"
    assert [p.rsplit(":", 1)[-1] for p in services["jaeger"]["ports"]] == ["16686"]
    assert all(p.startswith("127.0.0.1:") for p in services["jaeger"]["ports"]), "trace UI on the host only"


def test_stages_share_the_schedulers_namespaces(services: dict[str, Any]) -> None:
    scheduler = services["scheduler"]
    assert scheduler["ipc"] == "shareable", "other containers may only join a shareable IPC namespace"
    size = re.fullmatch(r"(\d+)([kmg]?)b?", str(scheduler["shm_size"]).lower())
    assert size and int(size[1]) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[size[2]] >= 256 * 2**20
    for role in STAGES:
        assert services[role]["network_mode"] == "service:scheduler"
        assert services[role]["ipc"] == "service:scheduler"
        assert "shm_size" not in services[role], "the bank lives in the scheduler's /dev/shm"
        assert services[role]["depends_on"]["scheduler"]["condition"] == "service_started"


def test_grpc_healthchecks(services: dict[str, Any]) -> None:
    for name in CDB_SERVICES:
        check = services[name]["healthcheck"]
        test = check["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.healthcheck"], name
        (listen,) = flag_values(command_argv(services[name]), "--listen")
        assert test[4] == "127.0.0.1:" + listen.rsplit(":", 1)[1], "probe the service's own port on loopback"
        assert check["start_period"] and check["interval"] and check["retries"] >= 1


def test_tracing_environment(services: dict[str, Any]) -> None:
    names = set()
    for name in CDB_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_always_on"
        names.add(env["OTEL_SERVICE_NAME"])
    assert names == {"cdb-scheduler", "cdb-prelude", "cdb-loop", "cdb-head"}
    assert services["scheduler"]["environment"]["CDB_METRICS_ADDR"] == "0.0.0.0:9464"
    assert services["otel-collector"]["volumes"] == ["./deploy/otel-collector.yaml:/etc/otelcol/config.yaml:ro"]


def test_collector_config_forwards_traces_to_jaeger() -> None:
    config = yaml.safe_load(COLLECTOR.read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    exporters = {name: config["exporters"][name] for name in pipeline["exporters"]}
    assert exporters["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert set(pipeline["processors"]) <= set(config["processors"])


def test_checkpoint_volume(services: dict[str, Any]) -> None:
    for name in CDB_SERVICES:
        assert services[name]["volumes"] == ["./models:/models:ro"], name
    env = {"CDB_MODELS_DIR": "/srv/ckpt", "CDB_MODEL": "/models/huginn"}
    custom = interpolate(load(), env)["services"]
    assert custom["loop"]["volumes"] == ["/srv/ckpt:/models:ro"]
    assert flag_values(command_argv(custom["loop"]), "--model") == ["/models/huginn"]


def test_gpu_override_reserves_the_gpu_for_the_stages(compose: dict[str, Any]) -> None:
    merged = interpolate(merge(compose, load(GPU_OVERRIDE)), {})["services"]
    base = interpolate(compose, {})["services"]
    assert "deploy" not in merged["scheduler"], "the scheduler holds no tensors"
    assert len({merged[name]["image"] for name in CDB_SERVICES}) == 1
    for role in STAGES:
        (device,) = merged[role]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] == "all"
        assert merged[role]["command"] == base[role]["command"] + " --device cuda"
        assert merged[role]["pid"] == "service:scheduler", "CUDA IPC between the stage processes"
        assert merged[role]["network_mode"] == merged[role]["ipc"] == "service:scheduler"
    assert "cu" in merged["scheduler"]["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[1]


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim$", text, re.M)
    assert "ARG PYTHON_VERSION=3.11" in text and "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert '"torch==${TORCH_VERSION}"' in text and "pip install /app" in text
    assert re.search(r"^EXPOSE 50051 9464$", text, re.M)
    assert re.search(r"^USER \w+", text, re.M), "not root"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "models/*", "!models/ouro-kjv"} <= set(ignored), "only the shipped model"
