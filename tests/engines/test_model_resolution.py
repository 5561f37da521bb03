"""Model resolution, step by step in the documented order, and the interactive prompt
driven through a pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import os
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.support.fakes import REPO_ROOT, make_model_folder
from velocity_fast.engines.errors import ModelPathError, ModelPromptAborted
from velocity_fast.engines.models import check_model_folder, resolve_model


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """A working folder, a HOME, and a clean environment for resolution."""
    cwd = tmp_path / "work"
    home = tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    monkeypatch.delenv("VELOCITY_MODEL_PATH", raising=False)
    monkeypatch.setenv("HOME", str(home))
    return cwd, home


def resolve(cwd, **kw):
    return resolve_model(cwd=cwd, interactive=False, **kw)


def test_order_flag_then_env_then_local_then_home(dirs, tmp_path, monkeypatch):
    cwd, home = dirs
    flag = make_model_folder(tmp_path / "given", "flag-model")
    env = make_model_folder(tmp_path / "env", "env-model")
    local = make_model_folder(cwd / "models", "local-model")
    homed = make_model_folder(home / "velocity-models", "home-model")
    monkeypatch.setenv("VELOCITY_MODEL_PATH", str(env))

    c = resolve(cwd, model_path=str(flag))
    assert (c.path, c.name, c.source) == (flag, "flag-model", "--model-path")
    c = resolve(cwd)
    assert (c.path, c.source) == (env, "VELOCITY_MODEL_PATH")
    monkeypatch.delenv("VELOCITY_MODEL_PATH")
    c = resolve(cwd)
    assert (c.path, c.source) == (local, "./models")
    (local / "config.json").unlink()
    c = resolve(cwd)
    assert (c.path, c.source) == (homed, "~/velocity-models")
    (homed / "config.json").unlink()
    assert resolve(cwd) is None


def test_local_search_takes_the_first_folder_by_name_and_looks_one_level_deeper(dirs):
    cwd, _ = dirs
    (cwd / "models" / "a-empty").mkdir(parents=True)
    make_model_folder(cwd / "models", "c-model")
    nested = make_model_folder(cwd / "models" / "b-org", "b-model")
    assert resolve(cwd).path == make_model_folder(cwd / "models", "c-model")
    (cwd / "models" / "c-model" / "config.json").unlink()
    assert resolve(cwd).path == nested


def test_home_comes_from_the_home_variable(dirs, tmp_path, monkeypatch):
    cwd, _ = dirs
    other_home = tmp_path / "other-home"
    model = make_model_folder(other_home / "velocity-models", "m")
    assert resolve(cwd) is None
    monkeypatch.setenv("HOME", str(other_home))
    assert resolve(cwd).path == model
    # "~" in a given path means the same HOME.
    assert resolve(cwd, model_path="~/velocity-models/m").path == model


def test_a_given_folder_without_config_json_is_a_clear_error(dirs, tmp_path, monkeypatch):
    cwd, _ = dirs
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(ModelPathError, match=r"has no config\.json"):
        resolve(cwd, model_path=str(empty))
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve(cwd, model_path=str(tmp_path / "missing"))
    # A bad path is an error even when another model could be found further down.
    make_model_folder(cwd / "models", "fine")
    monkeypatch.setenv("VELOCITY_MODEL_PATH", str(empty))
    with pytest.raises(ModelPathError, match=r"VELOCITY_MODEL_PATH: .*config\.json"):
        resolve(cwd)


def test_a_file_is_not_a_model_folder(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ModelPathError, match="not a folder"):
        check_model_folder(f)


def test_no_prompt_when_stdin_is_not_a_terminal(dirs):
    cwd, _ = dirs
    out = io.StringIO()
    assert resolve_model(cwd=cwd, stdin=io.StringIO("/never/read\n"), stdout=out) is None
    assert out.getvalue() == ""


def test_prompt_from_streams_asks_again_after_a_bad_path(dirs, tmp_path):
    cwd, _ = dirs
    good = make_model_folder(tmp_path, "answered")
    out = io.StringIO()
    c = resolve_model(cwd=cwd, interactive=True, stdin=io.StringIO(f"{tmp_path}\n{good}\n"), stdout=out)
    assert (c.path, c.source) == (good, "prompt")
    assert out.getvalue().count("Model folder") == 2 and "no config.json" in out.getvalue()
    assert resolve_model(cwd=cwd, interactive=True, stdin=io.StringIO("\n"), stdout=out) is None
    with pytest.raises(ModelPromptAborted):
        resolve_model(cwd=cwd, interactive=True, stdin=io.StringIO(""), stdout=out)


# ---- the prompt on a real pseudo-terminal -------------------------------------------

CHILD = """
import sys
from velocity_fast.engines.models import resolve_model
from velocity_fast.engines.errors import ModelPromptAborted
try:
    c = resolve_model(cwd=sys.argv[1])
except ModelPromptAborted as exc:
    print("ABORTED:", exc, flush=True)
    sys.exit(130)
print("RESULT", None if c is None else f"{c.source} {c.path}", flush=True)
"""


class PtyChild:
    """A child whose controlling terminal is a pty we type into."""

    def __init__(self, cwd: Path, home: Path):
        self.master, slave = os.openpty()
        env = dict(os.environ, HOME=str(home), PYTHONPATH=str(REPO_ROOT))
        env.pop("VELOCITY_MODEL_PATH", None)

        def make_controlling_tty():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # A runner started in the background by a shell without job control (`cmd &`)
            # ignores SIGINT, and an ignored signal stays ignored across exec: Python
            # would then install no KeyboardInterrupt handler and Ctrl-C would do nothing.
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(cwd)],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            preexec_fn=make_controlling_tty,
            close_fds=True,
        )
        os.close(slave)
        self.seen = b""

    def expect(self, marker: bytes, timeout: float = 20.0) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {marker!r}; got {self.seen!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                assert chunk, f"terminal closed before {marker!r}; got {self.seen!r}"
                self.seen += chunk
        return self.seen

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self.master)


@pytest.fixture
def pty_child(dirs):
    cwd, home = dirs
    children = []

    def start():
        child = PtyChild(cwd, home)
        children.append(child)
        return child

    yield start
    for child in children:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def test_prompt_on_a_terminal_checks_config_json_and_asks_again(pty_child, tmp_path):
    good = make_model_folder(tmp_path, "typed-model")
    bad = tmp_path / "no-config"
    bad.mkdir()
    child = pty_child()
    child.expect(b"Model folder")
    child.send(f"{bad}\n".encode())
    child.expect(b"try again")
    assert b"has no config.json" in child.seen
    child.send(f"{good}\n".encode())
    child.expect(f"RESULT prompt {good}".encode())
    assert child.close() == 0
    assert child.seen.count(b"Model folder") == 2


def test_prompt_empty_answer_means_no_model(pty_child):
    child = pty_child()
    child.expect(b"Model folder")
    child.send(b"\n")
    child.expect(b"RESULT None")
    assert child.close() == 0


@pytest.mark.parametrize("keys, why", [(b"\x03", b"Ctrl-C"), (b"\x04", b"end of input")])
def test_prompt_ctrl_c_and_eof_exit_cleanly_with_a_message(pty_child, keys, why):
    child = pty_child()
    child.expect(b"Model folder")
    child.send(keys)
    child.expect(b"ABORTED: model prompt")
    assert child.close() == 130
    assert why in child.seen
    assert b"Traceback" not in child.seen


def test_no_prompt_without_a_terminal(dirs):
    cwd, home = dirs
    env = dict(os.environ, HOME=str(home), PYTHONPATH=str(REPO_ROOT))
    env.pop("VELOCITY_MODEL_PATH", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(cwd)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=env,
        timeout=30,
    )
    assert done.returncode == 0
    assert done.stdout.strip() == b"RESULT None"
    assert b"Model folder" not in done.stderr
