"""``velocityllm chargeVelocity --mock`` as the benchmark's child (the harness's gateway
process): started on free ports, ready once admin ``/ready`` answers, its ``/stats``
sampled, stopped with the whole process group, so that the sim engines it started go too."""

from __future__ import annotations

import os
import signal

from ..harness import gateway
from ..harness.ports import free_port_range


class GatewayProcess(gateway.GatewayProcess):
    """``chargeVelocity --mock`` under ``policy`` with ``engines`` sim engines, its output in
    ``log_path``."""

    def __init__(self, policy: str, *, engines: int, log_path: str, extra: list[str] = ()) -> None:
        # Own engine ports and log folder, so that runs never meet each other's engines
        # (or anyone's on the default 8100+). The caller's VELOCITY_* variables stay: they
        # set the measured gateway as they would set the user's own. If the bench itself
        # is killed, the gateway gets SIGTERM and stops its engines: no orphans either way.
        super().__init__(
            "chargeVelocity",
            "--mock",
            "--engines",
            str(engines),
            "--policy",
            policy,
            "--engine-base-port",
            str(free_port_range(engines)),
            "--engine-log-dir",
            os.path.splitext(log_path)[0] + "-engines",
            *extra,
            log=log_path,
            clean=False,
            death_signal=signal.SIGTERM,
        )
        self.policy = policy
        self.log_path = log_path


def gauges(stats: dict) -> tuple[float | None, float | None, float | None]:
    """(sum of the endpoints' concurrency limits, total queued requests, requests in
    flight on the engines) from ``/stats``.

    The document's exact shape belongs to the gateway; this looks for the documented
    ideas (per endpoint ``limit``, per band queue depth) at the top level and under
    ``admission``, and tolerates their absence.
    """
    adm = stats.get("admission")
    if isinstance(adm, dict):
        stats = {**adm, **stats}
    limit = inflight = None
    eps = stats.get("endpoints")
    if isinstance(eps, dict):
        eps = list(eps.values())
    if isinstance(eps, list):
        limit = _sum(e.get("limit") for e in eps if isinstance(e, dict))
        inflight = _sum(e.get("inflight") for e in eps if isinstance(e, dict))
    if limit is None:
        for key in ("concurrency_limit", "limit_total", "concurrency_limits"):
            v = stats.get(key)
            if isinstance(v, (int, float)):
                limit = float(v)
            elif isinstance(v, dict):
                nums = [x for x in v.values() if isinstance(x, (int, float))]
                limit = float(sum(nums)) if nums else None
            if limit is not None:
                break
    queued = None
    for key in ("queue_depth", "queued", "queue"):
        v = stats.get(key)
        if isinstance(v, (int, float)):
            queued = float(v)
        elif isinstance(v, dict):
            nums = [x.get("depth", x.get("queued")) if isinstance(x, dict) else x for x in v.values()]
            nums = [x for x in nums if isinstance(x, (int, float))]
            queued = float(sum(nums)) if nums else None
        if queued is not None:
            break
    if queued is None and isinstance(stats.get("bands"), (dict, list)):
        bands = stats["bands"]
        bands = bands.values() if isinstance(bands, dict) else bands
        nums = [b.get("queue_depth", b.get("queued", b.get("depth"))) for b in bands if isinstance(b, dict)]
        nums = [x for x in nums if isinstance(x, (int, float))]
        queued = float(sum(nums)) if nums else None
    return limit, queued, inflight


def _sum(values) -> float | None:
    nums = [x for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return float(sum(nums)) if nums else None
