"""compose.yaml, its GPU override and the deploy/ configs agree with the code
(issue 6, acceptance 3): every splitserve service's command parses with the
real CLI parser, the ports and env vars it names exist, Prometheus scrapes every
service, and the Grafana dashboard queries only metrics the services export.
`docker compose config` runs too where docker compose is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from services import cli, healthcheck
from services.frontend.config import build_parser as frontend_parser
from services.frontend.config import parse_config
from services.observability.metric_names import PREFIX, series_names

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("frontend", "prefill", "decode")
# Env vars of third-party images, with who reads them.
IMAGE_ENV = {"jaeger": {"COLLECTOR_OTLP_ENABLED"},
             "grafana": {"GF_AUTH_ANONYMOUS_ENABLED", "GF_AUTH_ANONYMOUS_ORG_ROLE",
                         "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"}}
NO_METRICS = {"redis"}  # serves no /metrics endpoint


def code_source() -> str:
    """All the product's Python, for checking that a name a config uses is read somewhere."""
    return "\n".join(p.read_text() for d in ("engine", "services", "kvtransfer")
                     for p in (ROOT / d).rglob("*.py"))


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set; a bare ${VAR} would need an .env file."""
    assert not re.search(r"\$\{\w+\}", value), f"{value!r}: give a default (${{VAR:-default}})"
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def parse_command(role: str, command: list[str]) -> Any:
    """What the image's ENTRYPOINT (`splitserve`) does with the command."""
    argv = [interpolate(a) for a in command]
    assert argv[0] == role and role in cli.SERVICES
    if role == "frontend":
        parse_config(argv[1:])  # the frontend's own checks too (discovery needs --redis-url)
        return frontend_parser().parse_args(argv[1:])
    import importlib

    return importlib.import_module(f"services.{role}.__main__").build_parser().parse_args(argv[1:])


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load("compose.yaml")


@pytest.fixture(scope="module")
def args(compose: dict[str, Any]) -> dict[str, Any]:
    return {role: parse_command(role, compose["services"][role]["command"]) for role in ROLES}


def healthcheck_target(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "services.healthcheck"]
    return str(healthcheck.build_parser().parse_args(test[4:]).target)


def test_splitserve_services_parse_and_listen_where_compose_says(compose: dict[str, Any],
                                                                 args: dict[str, Any]) -> None:
    services = compose["services"]
    fe = args["frontend"]
    assert fe.host == "0.0.0.0"
    published = {int(p.split(":")[-1]) for p in services["frontend"]["ports"]}
    assert published == {fe.port, fe.grpc_port}
    assert urlparse(healthcheck_target(services["frontend"])).port == fe.port
    assert fe.decode == () and fe.prefill == ()  # workers are discovered, never addressed
    for role in ("prefill", "decode"):
        a = args[role]
        assert a.host == "0.0.0.0" and a.grpc_port and a.ucx_port and a.metrics_port
        assert a.advertise_host is None  # the container's own address
        assert urlparse(healthcheck_target(services[role])).port == a.grpc_port
        assert "ports" not in services[role], "a fixed host port would break --scale"
    assert args["decode"].local_prefill_threshold == fe.local_prefill_threshold


def test_names_it_uses_exist(compose: dict[str, Any], args: dict[str, Any]) -> None:
    services = compose["services"]
    source = code_source()
    for name, service in services.items():
        for var in service.get("environment", {}):
            if name in ROLES:  # NAME_FILE: the secret NAME read from a file (services/secret_env.py)
                read = var.removesuffix("_FILE")
                assert re.search(rf"[\"']{read}[\"']", source), f"{name}: nothing reads ${var}"
            else:
                assert var in IMAGE_ENV.get(name, set()), f"{name}: unknown env var {var}"
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no health check"
        for volume in service.get("volumes", []):
            src = volume.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: {src} is not in the repo"
            else:
                assert src in compose["volumes"], f"{name}: undeclared volume {src}"
    for role in ROLES:
        redis_url = urlparse(args[role].redis_url)
        assert redis_url.hostname == "redis" and redis_url.port == 6379
        otlp = urlparse(services[role]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert otlp.hostname == "jaeger" and otlp.port == 4317
    jaeger_ports = {int(p.split(":")[-1]) for p in services["jaeger"]["ports"]}
    assert {4317, 16686} <= jaeger_ports
    # The image: `splitserve` as entrypoint, the code's ports exposed.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["splitserve"]' in dockerfile
    exposed = {int(p) for line in dockerfile.splitlines() if line.startswith("EXPOSE")
               for p in line.split()[1:]}
    assert {args["frontend"].port, args["frontend"].grpc_port, args["decode"].grpc_port,
            args["decode"].ucx_port, args["decode"].metrics_port} <= exposed


SECRETS = {"frontend": ["cluster_token", "redis_password", "api_keys"],
           "prefill": ["cluster_token", "redis_password"], "decode": ["cluster_token", "redis_password"],
           "redis": ["redis_password"], "prometheus": ["metrics_key"]}


def test_secure_by_default(compose: dict[str, Any], args: dict[str, Any]) -> None:
    """Secrets only as compose secrets (files the setup script makes), never in
    env values or argv; published ports on loopback only; Redis wants its
    password; Grafana's anonymous users only view."""
    services = compose["services"]
    made = (ROOT / "scripts" / "compose-secrets.sh").read_text()
    for name, secret in compose["secrets"].items():
        assert interpolate(secret["file"]) == f"./secrets/{name}"
        assert f"secrets/{name}" in made or f"make {name} " in made, f"the setup script does not make {name}"
    for name, service in services.items():
        assert service.get("secrets", []) == SECRETS.get(name, []), name
        env = service.get("environment", {})
        for var, value in env.items():
            if var.endswith("_FILE"):
                assert value == f"/run/secrets/{value.rsplit('/', 1)[1]}" and value.rsplit("/", 1)[1] in \
                    service["secrets"], (name, var)
            assert not re.search("TOKEN|PASSWORD|API_KEY|SECRET", var) or var.endswith("_FILE"), (name, var)
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    for role in ROLES:
        assert args[role].cluster_token is None and "@" not in args[role].redis_url  # nothing secret in argv
    assert not args["frontend"].api_key
    redis = " ".join(services["redis"]["command"])
    assert "--requirepass" in redis and "/run/secrets/redis_password" in redis
    assert "/run/secrets/redis_password" in " ".join(services["redis"]["healthcheck"]["test"])
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert 'USER 10001' in (ROOT / "Dockerfile").read_text()
    [frontend_job] = [j for j in load("deploy/prometheus/prometheus.yml")["scrape_configs"]
                      if j["job_name"] == "frontend"]
    assert frontend_job["authorization"]["credentials_file"] == "/run/secrets/metrics_key"


def test_prometheus_scrapes_every_service(compose: dict[str, Any], args: dict[str, Any]) -> None:
    services = compose["services"]
    mounts = [v for v in services["prometheus"]["volumes"] if v.endswith("/etc/prometheus/prometheus.yml:ro")]
    assert len(mounts) == 1
    config = load(mounts[0].split(":")[0])
    scraped: dict[str, set[int]] = {}
    for job in config["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                scraped.setdefault(host, set()).add(int(port))
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A"  # every replica of a scaled service
            for host in sd["names"]:
                scraped.setdefault(host, set()).add(int(sd["port"]))
    scraped["prometheus"] = scraped.pop("localhost")
    assert scraped.keys() == services.keys() - NO_METRICS
    assert scraped["frontend"] == {args["frontend"].port}
    assert scraped["prefill"] == {args["prefill"].metrics_port}
    assert scraped["decode"] == {args["decode"].metrics_port}


def test_grafana_dashboard_queries_known_metrics(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {target: ROOT / host for host, target in (v.split(":")[:2] for v in grafana["volumes"])}
    provisioning = mounts["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "datasources.yml").read_text())["datasources"]
    by_uid = {s["uid"]: s for s in sources}
    assert urlparse(by_uid["prometheus"]["url"]).hostname == "prometheus"
    assert urlparse(by_uid["jaeger"]["url"]).port == 16686
    [provider] = yaml.safe_load((provisioning / "dashboards" / "dashboards.yml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (dashboards / home.rsplit("/", 1)[1]).is_file()
    dashboard = json.loads((dashboards / "splitserve.json").read_text())
    known = series_names()
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] in by_uid
        for target in panel["targets"]:
            names = set(re.findall(rf"\b{PREFIX}\w+", target["expr"]))
            assert names, f"{panel['title']}: {target['expr']} names no splitserve metric"
            assert names <= known, f"{panel['title']}: unknown {sorted(names - known)}"
            used |= names
    for var in dashboard["templating"]["list"]:
        assert set(re.findall(rf"\b{PREFIX}\w+", var["definition"])) <= known
    # What the issue asks the dashboard to show.
    for needed in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "generation_tokens_total", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "kv_transfer_bytes_total",
                   "spec_decode_num_accepted_tokens_total"):
        assert PREFIX + needed in used, needed


def test_gpu_override_reserves_gpus_and_parses() -> None:
    gpu = load("compose.gpu.yaml")["services"]
    for role in ("prefill", "decode"):
        args = parse_command(role, gpu[role]["command"])
        assert args.device == "cuda"
        [device] = gpu[role]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["frontend"]["image"] == gpu["decode"]["image"]


def _docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _docker_compose(), reason="docker compose is not installed here")
def test_docker_compose_config() -> None:
    for files in (["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]):
        argv = ["docker", "compose", *(a for f in files for a in ("-f", f)), "config", "--quiet"]
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_healthcheck_command_tells_serving_from_not() -> None:
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main([f"grpc://127.0.0.1:{port}"]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main([f"grpc://127.0.0.1:{port}"]) == 1
    finally:
        server.stop(None)
    assert healthcheck.main([f"grpc://127.0.0.1:{port}", "--timeout", "0.5"]) == 1  # nothing listens
    assert healthcheck.main([f"http://127.0.0.1:{port}/health", "--timeout", "0.5"]) == 1
