"""bench/overhead.py --markdown: the prompt-size sweep as bench/README.md's table, with
the gateway's extra CPU per KiB over nginx's measured from the one-line request."""

from __future__ import annotations

import pytest

from tests.support.bench import bench_module

pytestmark = pytest.mark.timeout(30)


def _row(kib, nbytes, g_cpu, n_cpu, g_rps=1000.0, n_rps=1000.0):
    return {
        "kib": kib,
        "bytes": nbytes,
        "rps_ratio": g_rps / n_rps,
        "cpu_ratio": g_cpu / n_cpu,
        "targets": {
            "gateway": {"rps": g_rps, "cpu_us_per_req": g_cpu},
            "nginx": {"rps": n_rps, "cpu_us_per_req": n_cpu},
        },
    }


def test_the_table_has_a_row_a_size_and_the_extra_per_kib_above_the_small_request():
    ov = bench_module("overhead")
    # The gateway 1 µs over nginx at 85 B, then 1 µs more per KiB beyond it.
    rows = [_row(0, 85, 11.0, 10.0, 900.0), _row(16, 16 * 1024, 11.0 + (16 * 1024 - 85) / 1024, 10.0)]
    text = ov.markdown_sizes({"body_kb": {"rows": rows}})
    lines = text.splitlines()
    assert lines[0].startswith("| prompt |") and "extra µs per KiB" in lines[0]
    assert lines[2] == "| 85 B | 900 | 1000 | 0.90x | 11.0 | 10.0 | 1.10x | - |"
    assert lines[3].startswith("| 16 KiB |") and lines[3].endswith("| +1.000 |")
    assert len(lines) == 4


def test_a_size_of_0_is_the_one_line_request_and_a_negative_size_is_refused(capsys):
    ov = bench_module("overhead")
    with pytest.raises(SystemExit):
        ov.main(["--body-kb", "-1"])
    assert "sizes from 0 (the one-line request)" in capsys.readouterr().err
