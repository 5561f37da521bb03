"""The README is tested: every command and snippet in it runs here, as a newcomer would
run it, so a broken example fails CI.

The code blocks are read from README.md itself (not copied): `make run` and the curl
lines and the Python snippet against the gateway that `make run` started, the `serve`
example against local sim engines standing in for the two remote GPUs (the README's
10.0.0.x addresses are replaced, never reached), and the inline commands of the prose
(`serve --config`, `chargeVelocity --model-path` on a machine with fake GPUs and a fake
`vllm`, `detect`). Only `make test` is left out: it is the command running this test.

The same holds for docs/: every command line there (the lines of its `sh`/`bash` blocks,
and inline code that starts `velocityllm ...`, `bench/....py`, `make ...` or `python ...`)
is sorted by DOC_RULES into one it runs here, one another test runs (named), or one that
cannot run on this machine (systemd, docker, kubectl: said why); a command that fits no
rule fails, so a new command in the docs comes with its test. docs/operations.md's
configuration snippet is checked to load, and docs/configuration.md's example error is
the one the command prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import yaml

from tests.support.fakes import free_port_block, machine_env, make_model_folder
from tests.support.gateway import stop_group
from tests.support.sim import sim_engine
from velocity_fast.config import load_settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BIN = Path(sys.executable).parent


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(block: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        line = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if cur:
            cur += " " + line.strip()
        else:
            cur = line.strip()
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        if cur:
            out.append(cur)
        cur = ""
    return out


def env_for(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOCITY_")}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    # This checkout's code, whichever checkout the venv's `velocityllm` was installed from.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def wait_ready(admin_port: int, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        r = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"127.0.0.1:{admin_port}/ready"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if r.stdout == "200":
            return
        time.sleep(0.2)
    raise TimeoutError("not ready")


def popen(cmd, log: Path, **kw) -> subprocess.Popen:
    """A child in its own process group, its output in ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, **kw
        )


def run_sh(cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60, cwd=REPO, **kw
    )


def test_the_readme_has_the_examples_this_test_runs():
    """If an example is added, changed in kind or removed, this test says so."""
    bash = [commands(b) for b in blocks(README, "bash")]
    assert [c.split()[:2] for c in bash[0]] == [["make", "run"], ["make", "test"]]
    assert all(c.startswith("curl ") for c in bash[1])
    assert len(bash[2]) == 1 and bash[2][0].startswith(".venv/bin/velocityllm serve ")
    # "With a real vLLM on CPU": tests/vllm/test_vllm_charge.py runs its chargeVelocity line.
    assert bash[3][0].startswith("make build vllm-env vllm-models")
    assert bash[3][1].startswith(".venv/bin/velocityllm chargeVelocity --engine vllm ")
    assert len(bash) == 4 and len(blocks(README, "python")) == 1


def test_make_run_then_every_curl_line_and_the_python_snippet(tmp_path):
    """`make run`, then the README's own requests against it, with its ports moved off
    8000/9090 through the environment (which the README documents)."""
    port = free_port_block(2)
    env = env_for(VELOCITY_PORT=str(port), VELOCITY_ADMIN_PORT=str(port + 1), VELOCITY_HOST="127.0.0.1")
    (make_run, _make_test) = commands(blocks(README, "bash")[0])
    proc = popen(make_run, tmp_path / "run.log", shell=True, cwd=REPO, env=env)
    try:
        wait_ready(port + 1, proc, 180)
        local = {"localhost:8000": f"127.0.0.1:{port}", "localhost:9090": f"127.0.0.1:{port + 1}"}
        outputs = []
        for cmd in commands(blocks(README, "bash")[1]):
            for a, b in local.items():
                cmd = cmd.replace(a, b)
            r = run_sh(cmd)
            assert r.returncode == 0, (cmd, r.stdout, r.stderr)
            outputs.append(r.stdout)
        chat, native, metrics = outputs
        answer = orjson.loads(chat)
        assert "choices" in answer, chat
        assert answer["choices"][0]["message"]["content"], chat
        gen = orjson.loads(native)
        assert gen["priority"] == "high" and gen["tokens_generated"] == 16 and isinstance(gen["sla_met"], bool)
        assert "velocity_requests_total" in metrics
        snippet = blocks(README, "python")[0].replace("http://localhost:8000", f"http://127.0.0.1:{port}")
        r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 0, r.stderr
        assert "ChatCompletion(" in r.stdout and "velocity-sim" in r.stdout
        # A realistic prompt at default flags: a 64 KiB system prompt (about 16k tokens).
        big = {
            "messages": [
                {"role": "system", "content": "You are a careful assistant. " * 2260},
                {"role": "user", "content": "Hello"},
            ],
            "max_tokens": 8,
        }
        r = subprocess.run(
            [
                "curl",
                "-s",
                "-w",
                "\\n%{http_code}",
                f"127.0.0.1:{port}/v1/chat/completions",
                "-H",
                "content-type: application/json",
                "--data-binary",
                "@-",
            ],
            input=orjson.dumps(big),
            capture_output=True,
            timeout=60,
        )
        body, _, code = r.stdout.rpartition(b"\n")
        assert code == b"200" and orjson.loads(body)["usage"]["prompt_tokens"] > 16000, r.stdout[-400:]
    finally:
        stop_group(proc, 20)


def test_the_serve_example_against_local_engines(tmp_path):
    (serve,) = commands(blocks(README, "bash")[2])
    urls = re.findall(r"http://[\d.]+:\d+", serve)
    model = re.search(r"=http://[^=]+=(\S+)", serve).group(1)
    assert len(urls) == 2 and model
    with sim_engine(model=model, time_scale=10) as a, sim_engine(model=model, time_scale=10) as b:
        for url, eng in zip(urls, (a, b)):
            serve = serve.replace(url, eng.url)  # never the README's remote addresses
        port = free_port_block(2)
        cmd = (
            serve.replace(".venv/bin/velocityllm", str(BIN / "velocityllm"))
            + f" --host 127.0.0.1 --port {port} --admin-port {port + 1}"
        )
        proc = popen(cmd, tmp_path / "serve.log", shell=True, cwd=REPO, env=env_for())
        try:
            wait_ready(port + 1, proc)
            body = orjson.dumps(
                {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
            ).decode()
            seen = set()
            for _ in range(6):
                r = run_sh(
                    f"curl -s -D - 127.0.0.1:{port}/v1/chat/completions -H 'content-type: application/json' -d '{body}'"
                )
                assert " 200 " in r.stdout.split("\r\n", 1)[0], r.stdout
                seen.add(re.search(r"x-velocity-endpoint: (\S+)", r.stdout).group(1))
            assert seen <= {"gpu0", "gpu1"} and seen
            health = orjson.loads(run_sh(f"curl -s 127.0.0.1:{port}/health").stdout)
            assert health["policy"] == "dynamic" and health["healthy_endpoints"] == 2
        finally:
            stop_group(proc, 20)


def test_serve_with_the_example_config_file(tmp_path):
    """`velocityllm serve --config my.yaml`, my.yaml being deploy/config.example.yaml with
    its endpoints pointed at a local sim engine."""
    assert "velocityllm serve --config my.yaml" in README
    data = yaml.safe_load((REPO / "deploy" / "config.example.yaml").read_text())
    with sim_engine(model="llama", time_scale=10) as eng:
        port = free_port_block(2)
        data.update(
            host="127.0.0.1",
            port=port,
            admin_port=port + 1,
            api_key=None,
            endpoints=[{"name": "e1", "url": eng.url, "model": "llama"}],
        )
        data["tenants"] = [t for t in data["tenants"] if t.get("api_key") is None]
        cfg = tmp_path / "my.yaml"
        cfg.write_text(yaml.safe_dump(data))
        proc = popen(
            [str(BIN / "velocityllm"), "serve", "--config", str(cfg)], tmp_path / "log", cwd=tmp_path, env=env_for()
        )
        try:
            wait_ready(port + 1, proc)
            r = run_sh(
                f"curl -s 127.0.0.1:{port}/v1/completions -H 'content-type: application/json' "
                "-d '{\"model\":\"llama\",\"prompt\":\"Hello\",\"max_tokens\":4}'"
            )
            assert orjson.loads(r.stdout)["choices"][0]["text"], r.stdout
        finally:
            stop_group(proc, 20)


def test_charge_velocity_with_a_model_path_on_a_gpu_machine_and_detect(tmp_path):
    """`velocityllm chargeVelocity --model-path /models/my-model` and `velocityllm detect`,
    on a machine with two fake GPUs and a fake `vllm` (each engine a sim)."""
    assert "velocityllm chargeVelocity --model-path /models/my-model" in README
    assert "`velocityllm detect`" in README
    model = make_model_folder(tmp_path / "models", "my-model")
    record = tmp_path / "rec"
    record.mkdir()
    env = machine_env(2, record, base=env_for())
    det = subprocess.run(
        [str(BIN / "velocityllm"), "detect", "--model-path", str(model)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert det.returncode == 0 and "vllm" in det.stdout, det.stdout + det.stderr
    port = free_port_block(2)
    proc = popen(
        [
            str(BIN / "velocityllm"),
            "chargeVelocity",
            "--model-path",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--admin-port",
            str(port + 1),
            "--engine-base-port",
            str(free_port_block(2)),
        ],
        tmp_path / "log",
        cwd=tmp_path,
        env=env,
    )
    try:
        wait_ready(port + 1, proc)
        models = orjson.loads(run_sh(f"curl -s 127.0.0.1:{port}/v1/models").stdout)
        name = models["data"][0]["id"]
        r = run_sh(
            f"curl -s 127.0.0.1:{port}/v1/completions -H 'content-type: application/json' "
            f"-d '{{\"model\":\"{name}\",\"prompt\":\"Hi\",\"max_tokens\":4}}'"
        )
        assert orjson.loads(r.stdout)["choices"][0]["text"], r.stdout
        assert len(list(record.glob("launch-*.json"))) == 2  # one `vllm serve` per GPU
    finally:
        stop_group(proc, 20)


def test_the_operations_guide_config_snippet_loads():
    ops = (REPO / "docs" / "operations.md").read_text()
    (snippet,) = blocks(ops, "yaml")
    data = yaml.safe_load(snippet)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ops-{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        s = load_settings(str(path), env={})
    finally:
        path.unlink()
    assert [e.name for e in s.endpoints] == ["gpu0", "gpu1"]


# -- docs/ ----------------------------------------------------------------------------------------

DOCS = sorted((REPO / "docs").glob("*.md"))
_INLINE_COMMAND = re.compile(r"(\.venv/bin/)?velocityllm [\w-]|bench/[\w/]+\.py|make |python ")

# (pattern, how): "run" (run by this file), "test:bench" (a benchmark some test runs),
# "name" (a command's name in prose; its flags are the tables of docs/configuration.md,
# checked by tests/knobs/test_help_doc.py) or "cannot: <why>".
DOC_RULES = [
    (r"(sudo|systemctl|journalctl) .*", "cannot: needs root and systemd"),
    (r"docker run .* velocityllm chargeVelocity --mock", "run"),  # its command, run here
    (r"docker run --gpus .*", "cannot: needs docker and GPUs"),
    (r"docker .*", "cannot: needs docker"),
    (r"kubectl .*", "cannot: needs a Kubernetes cluster"),
    (r"[A-Z_]+=.*", "cannot: a line of an environment file, not a command"),
    (r"velocityllm (chargeVelocity|serve|sim-engine|detect|loadgen|bench)", "name"),
    (r"velocityllm version", "run"),
    (r"velocityllm sim-engine --kv-events-config JSON", "run"),
    (r"(bench/[\w/]+\.py|python3? -m bench\.[\w.]+)( .*)?", "test:bench"),
    # Precise routing offline (kv-events.md): the test runs these lines as the doc writes them.
    (r"velocityllm sim-engine --write-tokenizer \S+", "test:tests/engines/test_precise_offline.py"),
    (
        r"velocityllm sim-engine --port \d+ --tokenizer \S+ --kv-events-config .*",
        "test:tests/engines/test_precise_offline.py",
    ),
    (
        r"velocityllm serve --config gateway\.yaml --prefix precise --tokenizer \S+",
        "test:tests/engines/test_precise_offline.py",
    ),
    (r"velocityllm chargeVelocity --mock --prefix precise", "test:tests/engines/test_precise_offline.py"),
    # How vLLM engines are started from a python that imports vllm (`--vllm-python`, .vllm-venv):
    # the vllm tier's engines and its chargeVelocity --engine vllm test run it so.
    (r"python -m vllm\.entrypoints\.openai\.api_server", "test:tests/vllm/test_vllm_charge.py"),
    (r"make vllm-env( vllm-models)?", "cannot: installs vLLM (minutes, gigabytes); make test-vllm runs it"),
    # The workers' command: a config at a system path; the test runs `serve --workers 2`.
    (r"velocityllm serve --config /etc/velocityllm/config\.yaml --workers auto", "test:tests/e2e/test_workers_e2e.py"),
]
RUN_HERE = [p for p, how in DOC_RULES if how == "run"]


def _without_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line of docs/*.md."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for lang in ("sh", "bash"):
            out += [(path.name, c) for b in blocks(text, lang) for c in commands(b)]
        out += [
            (path.name, span)
            for span in re.findall(r"`([^`\n]+)`", _without_blocks(text))
            if _INLINE_COMMAND.match(span)
        ]
    return out


def rule_for(cmd: str) -> str:
    for pattern, how in DOC_RULES:
        if re.fullmatch(pattern, cmd):
            return how
    raise AssertionError(f"a command line of docs/ that no test runs and no rule explains: {cmd!r}")


def test_every_command_line_of_the_docs_is_run_or_said_why_not():
    found = doc_commands()
    assert len(found) > 20, "the docs' command lines were not found"
    for doc, cmd in found:
        how = rule_for(cmd)
        if how == "test:bench":  # a benchmark: some test runs it (tests/bench at smoke size, ...)
            m = re.match(r"python3? -m (bench\.[\w.]+)", cmd)
            script = m.group(1).replace(".", "/") + ".py" if m else re.match(r"bench/\S+\.py", cmd).group(0)
            module = script[:-3].replace("/", ".")
            assert (REPO / script).exists(), f"{doc}: {script} does not exist"
            tests = [t.read_text() for t in (REPO / "tests").rglob("test_*.py")]
            by_run_all = f'"{module}"' in (REPO / "bench" / "run_all.py").read_text() and any(
                '"bench.run_all"' in t for t in tests
            )  # tests/bench: python -m bench.run_all --smoke
            assert by_run_all or any(f'"{module}"' in t or Path(script).name in t for t in tests), (
                f"{doc}: no test runs {script}"
            )
        elif how.startswith("test:tests/"):  # a test file of its own runs what the line shows
            flag = re.search(r"--\w[\w-]*(?= \w+$)", cmd)
            text = (REPO / how[5:]).read_text()
            assert flag is None or flag.group(0) in text, f"{doc}: {how[5:]} does not run {cmd!r}"
    # Each command the tests below run is still in the docs.
    for pattern in RUN_HERE:
        assert any(re.fullmatch(pattern, c) for _, c in found), f"no command of the docs is {pattern!r} any more"


def test_velocityllm_version_as_the_docs_say():
    r = subprocess.run([str(BIN / "velocityllm"), "version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("velocityllm "), r.stdout + r.stderr


def test_the_containers_try_it_command_runs_here(tmp_path):
    """operations.md: `docker run ... velocityllm chargeVelocity --mock`: the container's
    command, run here (ports moved off 8000/9090 by the environment)."""
    ops = (REPO / "docs" / "operations.md").read_text()
    (line,) = [c for b in blocks(ops, "sh") for c in commands(b) if c.endswith("velocityllm chargeVelocity --mock")]
    args = line.split(" velocityllm ", 1)[1].split()
    port, engines = free_port_block(2), free_port_block(2)
    env = env_for(VELOCITY_PORT=str(port), VELOCITY_ADMIN_PORT=str(port + 1), VELOCITY_HOST="127.0.0.1")
    proc = popen(
        [str(BIN / "velocityllm"), *args, "--engine-base-port", str(engines)], tmp_path / "log", cwd=tmp_path, env=env
    )
    try:
        wait_ready(port + 1, proc)
        name = orjson.loads(run_sh(f"curl -s 127.0.0.1:{port}/v1/models").stdout)["data"][0]["id"]
        body = orjson.dumps({"model": name, "prompt": "Hi", "max_tokens": 4}).decode()
        r = run_sh(f"curl -s 127.0.0.1:{port}/v1/completions -H 'content-type: application/json' -d '{body}'")
        assert orjson.loads(r.stdout)["choices"][0]["text"], r.stdout
    finally:
        stop_group(proc, 20)


def test_the_sim_engine_with_the_kv_events_config_of_the_docs(tmp_path):
    """kv-events.md: `velocityllm sim-engine --kv-events-config JSON` with the JSON the page
    gives, its ports moved to free loopback ones."""
    doc = (REPO / "docs" / "kv-events.md").read_text()
    (block,) = [b for b in blocks(doc, "") if "--kv-events-config" in b]
    config = orjson.loads(" ".join(block.split()).split("--kv-events-config ", 1)[1].strip().strip("'"))
    assert config["enable_kv_cache_events"] is True
    pub, port = free_port_block(2), free_port_block(1)
    config.update(endpoint=f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{pub + 1}")
    proc = popen(
        [
            str(BIN / "velocityllm"),
            "sim-engine",
            "--port",
            str(port),
            "--kv-events-config",
            orjson.dumps(config).decode(),
        ],
        tmp_path / "log",
        cwd=tmp_path,
        env=env_for(),
    )
    try:
        deadline = time.monotonic() + 30
        while run_sh(f"curl -s -o /dev/null -w '%{{http_code}}' 127.0.0.1:{port}/health").stdout != "200":
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "the sim engine never answered /health"
            time.sleep(0.1)
    finally:
        stop_group(proc, 10)


def test_the_example_error_of_configuration_md_is_what_the_command_prints():
    doc = (REPO / "docs" / "configuration.md").read_text()
    example = re.search(r"e\.g\. `(config error: --sla-ms: [^`]+)`", " ".join(doc.split())).group(1)
    r = subprocess.run(
        [str(BIN / "velocityllm"), "serve", "--sla-ms", "-1", "--endpoint", "e1=http://127.0.0.1:9=m"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_for(),
    )
    assert r.returncode == 2 and r.stderr.strip() == f"velocityllm: {example}", r.stderr
