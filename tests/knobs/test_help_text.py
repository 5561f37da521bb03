"""What `--help` prints reads right: each flag once in the usage block, and a flag's help
agrees with what the command does when the flag is not given."""

from __future__ import annotations

import argparse
import re

import pytest

from velocity_fast.cli import COMMANDS, build_parser
from velocity_fast.loadgen.app import workload_config
from velocity_fast.loadgen.mix import mix_from_args
from velocity_fast.loadgen.workload import build_workload


def _commands() -> dict[str, argparse.ArgumentParser]:
    for a in build_parser()._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    raise AssertionError("no subcommands")


def _usage(cmd: str) -> str:
    return " ".join(_commands()[cmd].format_usage().split())


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c != "version"])
def test_the_usage_names_each_flag_once(cmd):
    """`[--warmup-requests WARMUP_REQUESTS]` reads as the flag twice; its value is named by kind."""
    doubled = [
        f"{flag} {value}"
        for flag, value in re.findall(r"\[(--[a-z-]+) ([A-Z_]+)", _usage(cmd))
        if flag[2:].replace("-", "_").upper() == value
    ]
    assert doubled == [], f"{cmd} --help repeats these flags' names as their values"


def _sla_help(cmd: str) -> str:
    (action,) = [a for a in _commands()[cmd]._actions if a.dest == "sla_ms"]
    fmt = _commands()[cmd]._get_formatter()
    return " ".join(fmt._expand_help(action).split())


def _sent_sla(argv: list[str]) -> set:
    args = build_parser().parse_args(["loadgen", "-n", "5", *argv])
    specs = build_workload(workload_config(args, "h"), mix_from_args(args))
    return {s.headers.get("x-velocity-sla-ms") for s in specs}


def test_loadgen_sla_help_says_what_loadgen_does():
    """Not given: goodput is judged against 3000 ms and no request carries an SLA; given: sent."""
    text = _sla_help("loadgen")
    assert "not sent" not in text
    assert "(default 3000)" in text and "sent as x-velocity-sla-ms only when given" in text
    assert _sent_sla([]) == {None}
    assert _sent_sla(["--sla-ms", "1500"]) == {"1500"}
    assert workload_config(build_parser().parse_args(["loadgen"]), "h").sla_ms == 3000.0


def test_bench_sla_help_says_it_is_sent():
    assert _sla_help("bench") == "SLA in ms that judges goodput, sent as x-velocity-sla-ms (default 3000.0)"
