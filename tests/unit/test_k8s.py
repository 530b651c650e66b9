"""deploy/k8s agrees with the code and with Kubernetes (issue 18): each overlay
is rendered the way kustomize renders it (resources, images, JSON 6902
patches), every built-in object validates against the Kubernetes schemas,
every splitserve container's command line parses with the real CLI parsers,
the probes and ports point where the flags say, drains outlast
--drain-timeout, the PromQL the autoscalers and monitors use names only
exported metrics, network policies open only what is needed, and checkov
finds nothing."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from services.observability.metric_names import PREFIX, series_names
from tests.unit.test_compose import ROLES, code_source, parse_command

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.30.0"
CRDS = {"ScaledObject", "ServiceMonitor"}  # validated by hand below
SECRET = "splitserve-secrets"
# Tools with dependencies of their own live in their own environment (scripts/setup.sh).
TOOLS = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve")) / "tools" / "bin"


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize DIR` gives, for the features the manifests use."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
    objs: list[dict[str, Any]] = []
    for res in kust["resources"]:
        path = directory / res
        objs += render(path) if path.is_dir() else load_docs(path)
    objs = copy.deepcopy(objs)
    for obj in objs:
        if "namespace" in kust:
            obj["metadata"]["namespace"] = kust["namespace"]
        for label in kust.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in kust.get("images", []):
        for c in containers_of(objs):
            name, _, _ = c["image"].partition(":")
            if name == image["name"]:
                c["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    for patch in kust.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [o for o in objs if o["kind"] == patch["target"]["kind"]
                   and o["metadata"]["name"] == patch["target"]["name"]]
        assert len(targets) == 1, f"{patch}: matches {len(targets)} objects"
        targets[0].update(jsonpatch.apply_patch(targets[0], ops))
    return objs


def containers_of(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for o in objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]]


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in args and env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """Each env var's value, with secrets and fields as placeholders."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == SECRET, f"{var['name']}: secrets come from {SECRET}"
            env[var["name"]] = f"secret-{ref['key']}"
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            env[var["name"]] = "10.0.0.7"
    return env


def splitserve_args(deployment: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = container_env(container)
    argv = [expand(a, env) for a in container["args"]]
    return container, parse_command(deployment["metadata"]["name"], argv)


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(K8S / "overlays" / request.param)


def test_builtin_objects_validate_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    for obj in rendered:
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_commands_parse_and_probes_ports_and_drain_match_the_flags(rendered: list[dict[str, Any]]) -> None:
    deployments = by_kind(rendered, "Deployment")
    services = by_kind(rendered, "Service")
    args = {role: splitserve_args(deployments[role]) for role in ROLES}
    fe_container, fe = args["frontend"]
    assert fe.decode == () and fe.prefill == ()  # workers are discovered
    assert {p["containerPort"] for p in fe_container["ports"]} == {fe.port, fe.grpc_port}
    assert fe_container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {p["port"] for p in services["frontend"]["spec"]["ports"]} == {fe.port, fe.grpc_port}
    for role in ("prefill", "decode"):
        container, a = args[role]
        spec = deployments[role]["spec"]["template"]["spec"]
        assert a.host == "0.0.0.0" and a.advertise_host == "10.0.0.7"  # the pod's own address
        assert {p["containerPort"] for p in container["ports"]} == {a.grpc_port, a.ucx_port, a.metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == a.grpc_port  # the gRPC health service
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] > a.drain_timeout + float(pre_stop[1])
        # The KV budget is bytes, and fits in the memory limit with room for the weights.
        assert a.kv_cache_memory > 1
        limit = container["resources"]["limits"]["memory"]
        assert limit.endswith("Gi") and int(limit[:-2]) << 30 >= a.kv_cache_memory + (1 << 30)
        assert a.num_threads == int(container["resources"]["limits"]["cpu"])
        svc = services[role]["spec"]
        assert svc["clusterIP"] == "None"  # headless: workers are reached pod by pod
        assert {p["port"] for p in svc["ports"]} == {a.grpc_port, a.ucx_port, a.metrics_port}
        assert args["decode"][1].local_prefill_threshold == fe.local_prefill_threshold
    for role in ROLES:
        redis = args[role][1].redis_url
        assert redis == "redis://redis:6379/0", redis  # the password comes from a file


def test_gpu_overlay_puts_workers_on_gpus() -> None:
    rendered = render(K8S / "overlays" / "gpu")
    deployments = by_kind(rendered, "Deployment")
    for role in ("prefill", "decode"):
        container, a = splitserve_args(deployments[role])
        assert a.device == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["image"].endswith("-cuda")
    assert "nvidia.com/gpu" not in json.dumps(deployments["frontend"])


def test_pods_run_as_non_root_with_secrets_from_the_secret(rendered: list[dict[str, Any]]) -> None:
    source = code_source()
    for name, dep in by_kind(rendered, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 10000
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"] and c["resources"]["limits"]
            if name in ROLES:  # secrets as files from the Secret's volume, never env values
                assert not any("valueFrom" in v and "secretKeyRef" in v["valueFrom"] for v in c["env"])
                mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
                secret_dirs = [mounts[v["name"]] for v in pod["volumes"]
                               if v.get("secret", {}).get("secretName") == SECRET]
                for var, value in container_env(c).items():
                    if var.startswith("SPLITSERVE_"):
                        read = var.removesuffix("_FILE")
                        assert re.search(rf"[\"']{read}[\"']", source), f"{name}: nothing reads ${var}"
                    if var.endswith("_FILE"):
                        assert any(value.startswith(d + "/") for d in secret_dirs), (name, var)
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    pdbs = by_kind(rendered, "PodDisruptionBudget")
    assert set(pdbs) == set(ROLES)
    deployments = by_kind(rendered, "Deployment")
    for name, pdb in pdbs.items():
        assert pdb["spec"]["selector"] == deployments[name]["spec"]["selector"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    ok = selector.get("matchLabels", {}).items() <= labels.items()
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        ok = ok and labels.get(expr["key"]) in expr["values"]
    return ok


def test_network_policies_open_only_what_each_pod_needs(rendered: list[dict[str, Any]]) -> None:
    pods = {name: d["spec"]["template"]["metadata"]["labels"]
            for name, d in by_kind(rendered, "Deployment").items()}
    policies = by_kind(rendered, "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}

    def allowed(dst: str, src: str | None, port: int) -> bool:
        """Does some policy let `src` (a pod, or None: anyone outside) reach dst:port?"""
        for p in policies.values():
            if not _selects(p["spec"]["podSelector"], pods[dst]):
                continue
            for rule in p["spec"].get("ingress", []):
                ports = {x["port"] for x in rule.get("ports", [])}
                if ports and port not in ports:
                    continue
                peers = rule.get("from")
                if peers is None or (src is not None and any(
                        "podSelector" in peer and "namespaceSelector" not in peer
                        and _selects(peer["podSelector"], pods[src]) for peer in peers)):
                    return True
        return False

    for port in (8000, 50051):
        assert allowed("frontend", None, port)
    for worker in ("prefill", "decode"):
        assert not allowed(worker, None, 50061) and not allowed(worker, None, 50071)
        assert allowed(worker, "frontend", 50061) and not allowed(worker, "frontend", 50071)
        for peer in ("prefill", "decode"):
            assert allowed(worker, peer, 50061) and allowed(worker, peer, 50071)
        assert not allowed(worker, "redis", 50061)
    assert not allowed("redis", None, 6379)
    for role in ROLES:
        assert allowed("redis", role, 6379)


def test_monitors_and_autoscalers_name_exported_metrics(rendered: list[dict[str, Any]]) -> None:
    services = by_kind(rendered, "Service")
    known = series_names()
    monitors = by_kind(rendered, "ServiceMonitor")
    scraped = set()
    for monitor in monitors.values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        for name, svc in services.items():
            if _selects(monitor["spec"]["selector"], svc["metadata"]["labels"]):
                port_names = {p["name"] for p in svc["spec"]["ports"]}
                assert all(e["port"] in port_names for e in monitor["spec"]["endpoints"])
                scraped.add(name)
    assert scraped == set(ROLES)
    deployments = by_kind(rendered, "Deployment")
    scaled = by_kind(rendered, "ScaledObject")
    assert set(scaled) == {"prefill", "decode"}
    for name, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
        assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"]
        for trigger in so["spec"]["triggers"]:
            assert trigger["type"] == "prometheus"
            query = trigger["metadata"]["query"]
            names = set(re.findall(rf"\b{PREFIX}\w+", query))
            assert names and names <= known, query
            assert f'role="{name}"' in query
            float(trigger["metadata"]["threshold"])
    assert "splitserve_num_prompt_tokens_waiting" in json.dumps(scaled["prefill"])


def test_checkov_finds_nothing() -> None:
    """The security scanner, from its own virtual environment (scripts/setup.sh)."""
    out = subprocess.run([str(TOOLS / "checkov"), "-d", str(K8S), "--framework", "kubernetes", "--quiet",
                          "--compact", "--skip-download", "-o", "json"],
                         capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    failed = [(f["check_id"], f["resource"]) for r in (report if isinstance(report, list) else [report])
              for f in r["results"]["failed_checks"]]
    assert not failed, failed
