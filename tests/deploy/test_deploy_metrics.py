"""Every metric the Grafana dashboard and the alert rules use exists in the gateway's real
/metrics, with the labels they group and match by. A gateway in front of a sim engine
serves a few requests (one of them declined) so that labelled series exist, then its
admin port is scraped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.support.gateway import running_gateway
from tests.support.sim import http_request, sim_engine

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = re.compile(r"\bvelocity_[a-z0-9_]+")
# `by (a, b)` groupings and `{a="x", b=~"y"}` matchers name labels a series must carry.
BY = re.compile(r"\bby\s*\(([^)]*)\)")
MATCHER = re.compile(r"(velocity_[a-z0-9_]+)\{([^}]*)\}")
# Labels Prometheus adds itself at scrape time.
TARGET_LABELS = {"instance", "job", "service", "namespace", "pod"}


def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "velocityllm-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            exprs.append(q["query"])
    return exprs


def _alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def _exposition(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """(sample names, label names seen per sample name) of a Prometheus text exposition."""
    families: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = kind
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split()[0]
            keys = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', rest.partition("}")[0])) if rest else set()
            labels.setdefault(name, set()).update(keys)
    names = set()
    for name, kind in families.items():
        names.add(name)
        if kind == "histogram":
            names.update({name + "_bucket", name + "_sum", name + "_count"})
    return names, labels


@pytest.fixture(scope="module")
def engine():
    with sim_engine(model="m1", time_scale=50) as eng:
        yield eng


async def _scrape(engine) -> tuple[str, dict[str, set[str]]]:
    """The /metrics text, and the label names each metric is declared with (for a
    family without samples yet, e.g. upstream errors when no engine failed)."""
    tenants = [
        {"name": "alpha", "api_key": "key-a"},
        {"name": "slow", "api_key": "key-s", "requests_per_second": 0.001, "burst": 1},
    ]
    async with running_gateway(engine, tenants=tenants) as gw:
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 4}
        for key, band in (("key-a", "high"), ("key-a", "normal"), ("key-a", "low"), ("key-s", None), ("key-s", None)):
            h = {"authorization": f"Bearer {key}", "content-type": "application/json"}
            if band:
                h["x-velocity-priority"] = band
            await http_request(gw.port, "POST", "/v1/chat/completions", chat, h)
        assert (await http_request(gw.admin_port, "GET", "/metrics")).status == 401  # keys configured
        r = await http_request(gw.admin_port, "GET", "/metrics", headers={"authorization": "Bearer key-a"})
        assert r.status == 200
        declared = {}
        for name in gw.registry.names():
            m = gw.registry.get(name)
            for suffix in ("", "_bucket", "_sum", "_count"):
                declared[name + suffix] = set(m.labelnames) | ({"le"} if suffix == "_bucket" else set())
        return r.body.decode(), declared


async def test_every_metric_of_the_dashboard_and_alerts_exists(engine):
    text, declared = await _scrape(engine)
    names, labels = _exposition(text)
    for name, keys in labels.items():
        assert keys <= declared.get(name, set()) | {"le"}, name
    for name in names:
        labels.setdefault(name, set()).update(declared.get(name, set()))
    assert 'velocity_rejections_total{reason="rate-limit"}' in text, "the declined request left no series"
    exprs = _dashboard_exprs() + _alert_exprs()
    used = {n for e in exprs for n in NAME.findall(e)}
    assert len(used) >= 15
    missing = sorted(used - names)
    assert not missing, f"referenced but not exported: {missing}"

    problems = []
    for e in exprs:
        metrics = NAME.findall(e)
        for name, body in MATCHER.findall(e):
            for key in re.findall(r"([a-zA-Z_]+)\s*=~?", body):
                if key not in TARGET_LABELS and key not in labels.get(name, set()):
                    problems.append(f"{name} has no label {key!r}: {e}")
        for group in BY.findall(e):
            for key in (k.strip() for k in group.split(",") if k.strip()):
                if key in TARGET_LABELS:
                    continue
                if not any(key in labels.get(m, set()) for m in metrics):
                    problems.append(f"no series of {sorted(set(metrics))} carries {key!r}: {e}")
    assert not problems, "\n".join(problems)


def test_the_exposition_parser_sees_labels():
    names, labels = _exposition(
        '# TYPE a_seconds histogram\na_seconds_bucket{band="x",le="1"} 0\n# TYPE b counter\nb 1\n'
    )
    assert names == {"a_seconds", "a_seconds_bucket", "a_seconds_sum", "a_seconds_count", "b"}
    assert labels["a_seconds_bucket"] == {"band", "le"}
