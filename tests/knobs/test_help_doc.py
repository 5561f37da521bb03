"""Each command's `--help` against docs/configuration.md ("Command-line flags") and against
the code, both ways:

- every flag a command's help lists has a row in the command's table, and every row is a
  flag of that command;
- the default a row gives is the one the help states (`(default X)`), and a row gives
  none where the help states none;
- the default the help states is the one the command uses: argparse's default, or, for
  gateway flags that leave it to the precedence flag > VELOCITY_* > file > default, the
  settings Struct's, and for sim-engine flags, SimConfig's;
- a flag with a default of its own (a number, a word) states it in its help.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import msgspec
import pytest

from velocity_fast.cli import COMMANDS, build_parser
from velocity_fast.config import Settings
from velocity_fast.gateway.flags import flag_overrides
from velocity_fast.routing.settings import RoutingSettings
from velocity_fast.sim.settings import SimConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
STATED = re.compile(r"\(default:? ([^)]*)\)")
CMDS = [c for c in COMMANDS if c != "version"]

# Flags whose help states no default although argparse has one, and why.
UNSTATED = {
    ("bench", "--output"): "where the results go is said by the flag's own help text",
    ("bench", "--server-arg"): "a list that starts empty",
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    for a in build_parser()._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    raise AssertionError("no subcommands")


def _help_flags(cmd: str) -> dict[str, tuple[argparse.Action, str | None]]:
    """First option string -> (action, the default its help states)."""
    p = _commands()[cmd]
    fmt = p._get_formatter()
    out = {}
    for a in p._actions:
        if not a.option_strings or a.help == argparse.SUPPRESS or a.dest == "help":
            continue
        m = STATED.search(fmt._expand_help(a) if a.help else "")
        out[", ".join(a.option_strings)] = (a, m.group(1) if m else None)
    return out


def _doc_rows(cmd: str) -> dict[str, str | None]:
    text = DOC.read_text()
    head = f"### `velocityllm {cmd}`\n"
    assert head in text, f"docs/configuration.md has no table of `{cmd}` flags"
    section = text.split(head, 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            m = re.fullmatch(r"\| ((?:`[^`]+`(?:, )?)+) \| (—|`[^`]*`) \| (.+) \|", line)
            assert m, f"{cmd}: a row that does not parse: {line}"
            flags = ", ".join(re.findall(r"`([^`]+)`", m.group(1)))
            rows[flags] = None if m.group(2) == "—" else m.group(2)[1:-1]
    return rows


@pytest.mark.parametrize("cmd", CMDS)
def test_every_flag_of_the_help_is_in_the_doc_and_back(cmd):
    helped, documented = set(_help_flags(cmd)), set(_doc_rows(cmd))
    assert sorted(helped - documented) == [], f"{cmd}: flags of --help without a row in docs/configuration.md"
    assert sorted(documented - helped) == [], f"{cmd}: rows of docs/configuration.md that --help does not list"


@pytest.mark.parametrize("cmd", CMDS)
def test_the_doc_gives_the_default_the_help_states(cmd):
    rows = _doc_rows(cmd)
    for flags, (_, stated) in _help_flags(cmd).items():
        assert rows[flags] == stated, f"{cmd} {flags}: the doc says {rows[flags]!r}, the help {stated!r}"


def _real_default(cmd: str, action: argparse.Action):
    """What the command uses when the flag is not given."""
    if action.default is not None:
        return action.default
    if cmd in ("serve", "chargeVelocity"):
        if action.dest in Settings.__struct_fields__:
            return getattr(Settings(), action.dest)
        if action.dest in RoutingSettings.__struct_fields__:
            return getattr(RoutingSettings(), action.dest)
    if cmd == "sim-engine" and action.dest in SimConfig.__dataclass_fields__:
        return getattr(SimConfig(), action.dest)
    return None


def _same(stated: str, real) -> bool:
    first = re.split(r"[,;] ", stated, maxsplit=1)[0].strip()
    if isinstance(real, bool):
        return first in (("on", "true") if real else ("off", "false"))
    if isinstance(real, (int, float)):
        try:
            return float(first) == float(real)
        except ValueError:
            return False
    return first == str(real)


@pytest.mark.parametrize("cmd", CMDS)
def test_the_default_the_help_states_is_the_one_used(cmd):
    for flags, (action, stated) in _help_flags(cmd).items():
        real = _real_default(cmd, action)
        if stated is not None and real is not None:
            assert _same(stated, real), f"{cmd} {flags}: --help says {stated!r}, the command uses {real!r}"
        if (
            stated is None
            and isinstance(real, (int, float, str))
            and not isinstance(real, bool)
            and (cmd, action.option_strings[0]) not in UNSTATED
        ):
            pytest.fail(f"{cmd} {flags}: uses {real!r} when not given, and its --help does not say so")


def test_charge_velocity_takes_endpoint_flags_as_the_doc_says():
    args = build_parser().parse_args(["chargeVelocity", "--endpoint", "e9=http://10.0.0.9:8000=llama"])
    assert [msgspec.to_builtins(e) for e in flag_overrides(args)["endpoints"]] == [
        {
            "name": "e9",
            "url": "http://10.0.0.9:8000",
            "model": "llama",
            "api_key": None,
            "kv_events": None,
            "role": "both",
        }
    ]
