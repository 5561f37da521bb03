"""`tracing:` (docs/tracing.md): the ratio's range, the collector from the key or
OpenTelemetry's own variables, and tracing refused at start when it cannot run (no
collector, or no OpenTelemetry packages: the error names the extra to install)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from velocity_fast.config import ConfigError, load_settings, traces_url

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("ratio", ["-0.1", "1.5", "lots"])
def test_a_ratio_outside_0_to_1_is_refused(tmp_path, ratio):
    f = tmp_path / "c.yaml"
    f.write_text(f"tracing:\n  sample_ratio: {ratio}\n  otlp_endpoint: http://127.0.0.1:4318\n")
    with pytest.raises(ConfigError, match=rf"^{f}: tracing.sample_ratio: "):
        load_settings(str(f), {}, env={})


def test_off_by_default_and_the_endpoint_is_optional_then():
    s = load_settings(None, {}, env={})
    assert s.tracing.sample_ratio == 0 and s.tracing.otlp_endpoint is None


def test_on_without_a_collector_is_refused():
    with pytest.raises(ConfigError) as ei:
        load_settings(None, {"tracing": {"sample_ratio": 0.5}}, env={})
    assert str(ei.value).startswith("--tracing: tracing.sample_ratio: tracing is on but has no collector")
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in str(ei.value)


def test_the_collector_from_opentelemetrys_variables(tmp_path):
    on = {"tracing": {"sample_ratio": 1.0}}
    # the base endpoint gets the traces path; the traces endpoint is a whole URL and wins
    s = load_settings(None, on, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://col:4318/"})
    assert s.tracing.otlp_endpoint == "http://col:4318/v1/traces"
    s = load_settings(
        None,
        on,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://col:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/x"},
    )
    assert s.tracing.otlp_endpoint == "http://t:9/x"
    # the key wins over both
    f = tmp_path / "c.yaml"
    f.write_text("tracing:\n  sample_ratio: 1\n  otlp_endpoint: http://mine:4318\n")
    s = load_settings(str(f), {}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://col:4318"})
    assert s.tracing.otlp_endpoint == "http://mine:4318"
    # a wrong one is named by the variable that gave it
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_ENDPOINT: tracing.otlp_endpoint: must be an http"):
        load_settings(None, on, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://col:4317"})


@pytest.mark.parametrize(
    "given, url",
    [
        ("http://col:4318", "http://col:4318/v1/traces"),
        ("http://col:4318/", "http://col:4318/v1/traces"),
        ("http://col:4318/v1/traces", "http://col:4318/v1/traces"),
        ("https://col/otlp/traces", "https://col/otlp/traces"),
    ],
)
def test_where_the_exporter_posts(given, url):
    assert traces_url(given) == url


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=30)


def test_without_the_otel_packages_tracing_is_refused_at_start_naming_the_extra(tmp_path):
    """A Python that cannot import opentelemetry: `serve` with tracing on stops with the
    one-line config error (exit 2) that says what to install; with tracing off it would start."""
    f = tmp_path / "c.yaml"
    f.write_text("tracing:\n  sample_ratio: 0.1\n  otlp_endpoint: http://127.0.0.1:4318\n")
    p = _run(
        f"""
        import sys
        sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
        from velocity_fast.cli import main
        sys.exit(main(["serve", "--config", {str(f)!r}, "--endpoint", "e1=http://127.0.0.1:1=m"]))
        """
    )
    assert p.returncode == 2, p.stderr
    assert f"config error: {f}: tracing.sample_ratio: tracing needs the OpenTelemetry SDK" in p.stderr
    assert "pip install 'velocityllm[otel]'" in p.stderr


def test_with_tracing_off_opentelemetry_is_never_imported():
    p = _run(
        """
        import asyncio, sys
        from velocity_fast.config import load_settings
        from velocity_fast.gateway.app import Gateway
        s = load_settings(None, {"host": "127.0.0.1", "port": 0, "admin_port": 0}, env={})
        gw = Gateway(s)
        assert gw.ingress.tracing is None
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
