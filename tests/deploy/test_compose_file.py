"""docker-compose.yml, its GPU, public and front-end overrides and the Collector config, checked without Docker:
validity against the Compose Specification schema, and the deployment's invariants."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from cdb_engine.config import DType, EngineConfig
from tests.deploy.compose_file import (
    CDB_SERVICES,
    COLLECTOR,
    COMPOSE,
    FRONTEND_SERVICE,
    FRONTENDS_OVERRIDE,
    GPU_OVERRIDE,
    LINK_DIR,
    POD_SERVICE,
    PUBLIC_OVERRIDE,
    SCHEMA,
    SECRET_SERVICE,
    STAGES,
    command_argv,
    flag_values,
    interpolate,
    interpolate_str,
    load,
    merge,
)
from tests.deploy.effective_config import check_consistent, effective

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is needed to validate the compose file")

# Each process's own flags only: the engine configuration is the shared x-cdb-env block.
SCHEDULER_CMD = (
    "python -m cdb scheduler --listen 0.0.0.0:50051 --stage prelude=127.0.0.1:50061 "
    "--stage loop=127.0.0.1:50062 --stage head=127.0.0.1:50063"
)
STAGE_CMD = "python -m cdb stage --role {role} --listen 127.0.0.1:{port}"
ENGINE_ENV = ("CDB_MODEL", "CDB_DTYPE", "CDB_EXIT_THRESHOLD", "CDB_MAX_NUM_SEQS")  # set once, for all four
STAGE_PORTS = {"prelude": 50061, "loop": 50062, "head": 50063}
SECRET_FILE = "/var/lib/cdb/secret/stage-secret"
SECRET_DIR = SECRET_FILE.rsplit("/", 1)[0]
OWN_IMAGE = (*CDB_SERVICES, POD_SERVICE, SECRET_SERVICE)
LONG_RUNNING = (*CDB_SERVICES, POD_SERVICE, "otel-collector", "jaeger")
DRAIN_TIMEOUT_S = 30.0  # CDB_DRAIN_TIMEOUT_S default (services/settings.py)


def _errors(doc: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _seconds(duration: str) -> float:
    """A compose duration such as ``45s`` or ``1m30s``."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}[u] for n, u in parts)


def _published(service: dict[str, Any]) -> dict[int, str]:
    """Container port -> host address it is published on."""
    out = {}
    for spec in service["ports"]:
        host_ip, _, container_port = spec.rsplit(":", 2)
        out[int(container_port)] = host_ip
    return out


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


@pytest.mark.parametrize(
    "env",
    [{}, {"CDB_MODEL": "/models/ouro-1.4b", "CDB_PORT": "6000", "CDB_SHM_SIZE": "4gb", "CDB_PUBLIC_BIND": "0.0.0.0"}],
)
def test_compose_file_is_valid(compose: dict[str, Any], env: dict[str, str]) -> None:
    assert _errors(compose) == []
    assert _errors(interpolate(compose, env)) == []


def test_gpu_override_is_valid(compose: dict[str, Any]) -> None:
    override = load(GPU_OVERRIDE)
    assert _errors(override) == []
    assert _errors(interpolate(merge(compose, override), {})) == []


def test_public_override_is_valid(compose: dict[str, Any]) -> None:
    override = load(PUBLIC_OVERRIDE)
    assert _errors(override) == []
    assert _errors(interpolate(merge(compose, override), {"CDB_TLS_DIR": "/srv/tls"})) == []


def test_frontends_override_is_valid(compose: dict[str, Any]) -> None:
    override = load(FRONTENDS_OVERRIDE)
    assert _errors(override) == []
    assert _errors(interpolate(merge(compose, override), {"CDB_FRONTENDS": "3"})) == []
    assert override["x-frontend-env"] == compose["x-cdb-env"], "the front ends read the engine options all read"


@pytest.mark.parametrize(
    "env",
    [{}, {"CDB_MODEL": "huginn-tiny", "CDB_MAX_NUM_SEQS": "8", "CDB_FRONTENDS": "3"}],
)
def test_front_ends_run_the_schedulers_config_and_reach_it_through_the_link_volume(
    compose: dict[str, Any], env: dict[str, str]
) -> None:
    merged = interpolate(merge(compose, load(FRONTENDS_OVERRIDE)), env)
    services = merged["services"]
    sched, front = services["scheduler"], services[FRONTEND_SERVICE]
    config = check_consistent(_processes(services))
    assert effective(command_argv(front), front["environment"]).engine == config, "validation as the engine's"
    sched_argv, front_argv = command_argv(sched), command_argv(front)
    assert front_argv[:4] == ["python", "-m", "cdb", FRONTEND_SERVICE]
    (link,) = flag_values(sched_argv, "--link")
    assert flag_values(front_argv, "--link") == [link] and link.startswith(f"unix:{LINK_DIR}/")
    assert flag_values(sched_argv, "--listen")[0].startswith(f"unix:{LINK_DIR}/"), "the scheduler's port: a socket"
    assert sched["healthcheck"]["test"][4] == flag_values(sched_argv, "--listen")[0]
    for svc in (sched, front):
        assert f"link:{LINK_DIR}" in svc["volumes"]
        assert svc["network_mode"] == "service:pod" and svc["ipc"] == "service:pod"
    # the front ends hold the link's secret, written by the one-shot writer beside the stage secret, and not that
    assert f"stage-secret:{SECRET_DIR}:ro" in sched["volumes"]
    assert not any(v.startswith("stage-secret:") for v in front["volumes"]), "a front end reaches no stage"
    link_secret = front["environment"]["CDB_LINK_SECRET_FILE"]
    assert front["environment"]["CDB_STAGE_SECRET_FILE"] == ""
    assert f"link-secret:{link_secret.rsplit('/', 1)[0]}:ro" in front["volumes"]
    writer = command_argv(services[SECRET_SERVICE])
    assert flag_values(writer, "--out") == [SECRET_FILE] and flag_values(writer, "--link-out") == [link_secret]
    assert "link" in merged["volumes"]
    assert flag_values(front_argv, "--listen") == ["0.0.0.0:50051"] and "--join" in front_argv, "shared ports"
    assert front["environment"]["CDB_HTTP_ADDR"] == "0.0.0.0:8000" and "ports" not in front
    replicas = int(env.get("CDB_FRONTENDS", "2"))
    assert int(front["deploy"]["replicas"]) == int(front["environment"]["CDB_FRONTENDS"]) == replicas
    assert front["depends_on"]["scheduler"]["condition"] == "service_started", "front ends stop first"
    assert _seconds(front["stop_grace_period"]) > DRAIN_TIMEOUT_S
    assert "docker-compose.frontends.yml" in (COMPOSE.parent / "docs" / "operations.md").read_text(), "documented"


def test_validation_catches_mistakes(compose: dict[str, Any]) -> None:
    """The schema really constrains: an unknown key, a wrong type."""
    bad = merge(compose, {"services": {"loop": {"netwrok_mode": "host"}}})
    assert any("netwrok_mode" in e for e in _errors(bad))
    bad = merge(compose, {"services": {"pod": {"ipc": ["shareable"]}}})
    assert any(e.startswith("services/pod/ipc") for e in _errors(bad))


def test_interpolation() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate_str("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $SET $$SET", env) == "v d d  v $SET"
    assert interpolate_str("${SET:+alt}|${UNSET:+alt}", env) == "alt|"
    with pytest.raises(ValueError, match="UNSET"):
        interpolate_str("${UNSET:?needed}", env)


def test_override_merge_rules() -> None:
    """Compose merges a service's volumes by container path and its ports by value; other lists are replaced."""
    base = {"volumes": ["./a:/a:ro", "v:/b"], "ports": ["1:1"], "command": ["x"]}
    over = {"volumes": ["./c:/a"], "ports": ["2:2", "1:1"], "command": ["y"]}
    assert merge(base, over) == {"volumes": ["v:/b", "./c:/a"], "ports": ["1:1", "2:2"], "command": ["y"]}


def test_services_and_commands(compose: dict[str, Any]) -> None:
    raw = compose["services"]
    assert set(raw) == {*CDB_SERVICES, POD_SERVICE, SECRET_SERVICE, "otel-collector", "jaeger"}
    assert raw["scheduler"]["command"] == SCHEDULER_CMD
    for role, port in STAGE_PORTS.items():
        assert raw[role]["command"] == STAGE_CMD.format(role=role, port=port)
    assert len({raw[name]["image"] for name in OWN_IMAGE}) == 1, "the cdb processes, pod and secret init: one image"
    assert all(raw[name]["build"]["context"] == "." for name in OWN_IMAGE)


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
        assert flag_values(argv, "--model") == [], "the model comes from the shared environment"


def _processes(services: dict[str, Any]) -> dict[str, tuple[list[str], dict[str, str]]]:
    return {name: (command_argv(services[name]), services[name]["environment"]) for name in CDB_SERVICES}


def test_the_engine_configuration_is_set_once(compose: dict[str, Any]) -> None:
    """dtype, threshold, width and model: one x-cdb-env block that every cdb service merges, no per-command flag."""
    shared = compose["x-cdb-env"]
    assert set(ENGINE_ENV) <= set(shared)
    for name in CDB_SERVICES:
        env = compose["services"][name]["environment"]
        assert {k: env[k] for k in ENGINE_ENV} == {k: shared[k] for k in ENGINE_ENV}, name
        argv = command_argv(compose["services"][name])
        assert not any(a.startswith(("--model", "--dtype", "--device", "--max-num-seqs", "--exit")) for a in argv)
    assert "CDB_EXIT_THRESHOLD" in COMPOSE.read_text() and "auto (= unset)" in COMPOSE.read_text(), "documented"


@pytest.mark.parametrize(
    "env",
    [{}, {"CDB_MODEL": "huginn-tiny", "CDB_DTYPE": "float64", "CDB_EXIT_THRESHOLD": "0.3", "CDB_MAX_NUM_SEQS": "8"}],
)
def test_the_four_processes_run_one_config(compose: dict[str, Any], env: dict[str, str]) -> None:
    """Command AND environment of each service, resolved by the processes' own parsers: the four agree, and the
    scheduler runs the config the launcher would give its children."""
    config = check_consistent(_processes(interpolate(compose, env)["services"]))
    if not env:
        assert config == EngineConfig(model="ouro-kjv"), "the defaults: auto dtype (float32 here), auto threshold"
    else:
        want = EngineConfig(model="huginn-tiny", dtype="float64", exit_threshold=0.3, max_num_seqs=8)
        assert config == want, "the host's values reach all four"


def test_only_the_pod_publishes_ports_on_loopback_by_default(services: dict[str, Any]) -> None:
    for name in (*CDB_SERVICES, SECRET_SERVICE, "otel-collector"):
        assert "ports" not in services[name], name
    assert _published(services[POD_SERVICE]) == {50051: "127.0.0.1", 8000: "127.0.0.1", 9464: "127.0.0.1"}
    assert [p.rsplit(":", 1)[-1] for p in services["jaeger"]["ports"]] == ["16686"]
    assert all(p.startswith("127.0.0.1:") for p in services["jaeger"]["ports"]), "trace UI on the host only"


def test_public_bind_opens_the_api_ports_only(compose: dict[str, Any]) -> None:
    """CDB_PUBLIC_BIND=0.0.0.0 (for TLS / API-key deployments) publishes gRPC and HTTP, never the metrics."""
    pod = interpolate(compose, {"CDB_PUBLIC_BIND": "0.0.0.0", "CDB_PORT": "6000"})["services"][POD_SERVICE]
    assert _published(pod) == {50051: "0.0.0.0", 8000: "0.0.0.0", 9464: "127.0.0.1"}
    assert "0.0.0.0:6000:50051" in pod["ports"]
    text = COMPOSE.read_text()
    assert "CDB_PUBLIC_BIND=0.0.0.0" in text and "deploy/docker-compose.public.yml" in text, "exposure is documented"


def test_public_override_turns_on_tls_and_api_keys(compose: dict[str, Any]) -> None:
    merged = interpolate(merge(compose, load(PUBLIC_OVERRIDE)), {"CDB_TLS_DIR": "/srv/tls"})["services"]
    scheduler = merged["scheduler"]
    assert "/srv/tls:/etc/cdb/tls:ro" in scheduler["volumes"]
    assert "./models:/models:ro" in scheduler["volumes"], "the override adds a mount and keeps the others"
    env = scheduler["environment"]
    assert env["CDB_TLS_CERT"] == "/etc/cdb/tls/tls.crt" and env["CDB_TLS_KEY"] == "/etc/cdb/tls/tls.key"
    assert env["CDB_API_KEYS_FILE"] == "/etc/cdb/tls/api-keys" and env["CDB_TLS_CLIENT_CA"] == ""
    assert env["CDB_MODEL"] == "ouro-kjv", "the base environment stays"
    assert scheduler["healthcheck"]["test"] == ["NONE"], "the plaintext probe cannot speak TLS"
    for role in STAGES:
        assert "CDB_TLS_CERT" not in merged[role]["environment"], "the stage plane stays on loopback"
    with pytest.raises(ValueError, match="CDB_TLS_DIR"):
        interpolate(merge(compose, load(PUBLIC_OVERRIDE)), {})


def test_stage_secret_init_service(compose: dict[str, Any], services: dict[str, Any]) -> None:
    init = services[SECRET_SERVICE]
    argv = command_argv(init)
    assert argv[:4] == ["python", "-m", "cdb", "secret"] and flag_values(argv, "--out") == [SECRET_FILE]
    assert init["restart"] == "no" and init["network_mode"] == "none"
    assert init["volumes"] == [f"stage-secret:{SECRET_DIR}"], "the one writer mounts it read-write"
    for name in CDB_SERVICES:
        svc = services[name]
        assert svc["environment"]["CDB_STAGE_SECRET_FILE"] == SECRET_FILE, name
        assert f"stage-secret:{SECRET_DIR}:ro" in svc["volumes"], name
        assert svc["depends_on"][SECRET_SERVICE] == {"condition": "service_completed_successfully"}, name
    assert "stage-secret" in compose["volumes"]


def test_restart_policies(services: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        assert services[name]["restart"] in ("unless-stopped", "always", "on-failure"), name
    for name in CDB_SERVICES:
        assert services[name]["init"] is True, f"{name}: an init forwards SIGTERM and reaps"


def test_the_scheduler_stops_first_and_drains_within_its_grace(services: dict[str, Any]) -> None:
    scheduler = services["scheduler"]
    for role in STAGES:
        # Compose stops dependents before their dependencies: the stages outlive the scheduler's drain.
        assert scheduler["depends_on"][role] == {"condition": "service_started"}
        assert "scheduler" not in services[role]["depends_on"]
    assert _seconds(scheduler["stop_grace_period"]) > DRAIN_TIMEOUT_S + 5
    assert all(_seconds(services[role]["stop_grace_period"]) >= 10 for role in STAGES)


def test_processes_share_the_pods_namespaces(services: dict[str, Any]) -> None:
    pod = services[POD_SERVICE]
    assert pod["ipc"] == "shareable", "other containers may only join a shareable IPC namespace"
    assert pod["command"] == ["sleep", "infinity"] and pod["init"] is True
    size = re.fullmatch(r"(\d+)([kmg]?)b?", str(pod["shm_size"]).lower())
    assert size and int(size[1]) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[size[2]] >= 256 * 2**20
    for name in CDB_SERVICES:
        # Not the scheduler's namespaces: a restarted scheduler would leave the stages in a dead loopback.
        assert services[name]["network_mode"] == "service:pod", name
        assert services[name]["ipc"] == "service:pod", name
        assert "shm_size" not in services[name], "the bank lives in the pod's /dev/shm"
        assert services[name]["depends_on"][POD_SERVICE] == {"condition": "service_started"}, name


def test_grpc_healthchecks(services: dict[str, Any]) -> None:
    for name in CDB_SERVICES:
        check = services[name]["healthcheck"]
        test = check["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.healthcheck"], name
        (listen,) = flag_values(command_argv(services[name]), "--listen")
        assert test[4] == "127.0.0.1:" + listen.rsplit(":", 1)[1], "probe the service's own port on loopback"
        assert check["start_period"] and check["interval"] and check["retries"] >= 1


def test_tracing_metrics_and_http_environment(services: dict[str, Any]) -> None:
    names = set()
    for name in CDB_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_always_on"
        names.add(env["OTEL_SERVICE_NAME"])
    assert names == {"cdb-scheduler", "cdb-prelude", "cdb-loop", "cdb-head"}
    assert services["scheduler"]["environment"]["CDB_METRICS_ADDR"] == "0.0.0.0:9464"
    assert services["scheduler"]["environment"]["CDB_HTTP_ADDR"] == "0.0.0.0:8000"
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
        assert services[name]["volumes"] == ["./models:/models:ro", f"stage-secret:{SECRET_DIR}:ro"], name
    env = {"CDB_MODELS_DIR": "/srv/ckpt", "CDB_MODEL": "/models/huginn"}
    custom = interpolate(load(), env)["services"]
    assert custom["loop"]["volumes"][0] == "/srv/ckpt:/models:ro"
    assert all(custom[name]["environment"]["CDB_MODEL"] == "/models/huginn" for name in CDB_SERVICES)


def test_gpu_override_puts_the_scheduler_and_the_stages_on_the_gpu(compose: dict[str, Any]) -> None:
    merged = interpolate(merge(compose, load(GPU_OVERRIDE)), {})["services"]
    base = interpolate(compose, {})["services"]
    assert len({merged[name]["image"] for name in OWN_IMAGE}) == 1, "one (CUDA) image, built once"
    for name in CDB_SERVICES:
        # The scheduler allocates the bank on its device; the stages attach it by CUDA IPC.
        (device,) = merged[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] == "all", name
        assert merged[name]["command"] == base[name]["command"], "the device comes from the environment"
        assert merged[name]["environment"]["CDB_DEVICE"] == "cuda", name
        assert merged[name]["environment"]["OTEL_SERVICE_NAME"] == base[name]["environment"]["OTEL_SERVICE_NAME"]
        assert merged[name]["pid"] == "service:pod", "CUDA IPC between the processes: one PID namespace"
        assert merged[name]["network_mode"] == merged[name]["ipc"] == "service:pod"
    assert "deploy" not in merged[POD_SERVICE] and "deploy" not in merged[SECRET_SERVICE]
    assert "cu" in merged["scheduler"]["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[1]
    assert load(GPU_OVERRIDE)["x-gpu-process"]["environment"] == {"CDB_DEVICE": "${CDB_DEVICE:-cuda}"}, "set once"
    config = check_consistent(_processes(merged))
    assert (config.device, config.dtype) == ("cuda", DType.BFLOAT16), "all four on the GPU in bfloat16"
