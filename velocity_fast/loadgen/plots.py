"""PNG plots of a policy comparison (only when matplotlib is installed)."""

from __future__ import annotations


def have_matplotlib() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(
    prefix: str, latencies: dict[str, list[float]], timelines: dict[str, list[tuple]], sla_ms: float | None = None
) -> list[str]:
    """Write ``PREFIX_latency_cdf.png`` (latency CDF per policy, completed requests) and
    ``PREFIX_timeline.png`` (concurrency limit, in-flight requests and queue depth over
    time, per policy; samples are ``(t, limit, queued, inflight)`` with None for unknown).
    Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and no GUI backend imported
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, lat in latencies.items():
        if not lat:
            continue
        xs = sorted(lat)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=policy)
    if sla_ms:
        ax.axvline(sla_ms, color="grey", linestyle="--", label=f"SLA {sla_ms:.0f} ms")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title("Latency CDF per policy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(f"{prefix}_latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for k, (policy, samples) in enumerate(timelines.items()):
        color = f"C{k}"
        lim = [(s[0], s[1]) for s in samples if s[1] is not None]
        que = [(s[0], s[2]) for s in samples if s[2] is not None]
        inf = [(s[0], s[3]) for s in samples if len(s) > 3 and s[3] is not None]
        if lim:
            top.plot(*zip(*lim), color=color, label=f"{policy} limit")
        if inf:
            top.plot(*zip(*inf), color=color, linestyle=":", label=f"{policy} in flight")
        if que:
            bottom.plot(*zip(*que), color=color, label=policy)
    top.set_ylabel("requests (all engines)")
    bottom.set_ylabel("queued requests")
    bottom.set_xlabel("time since start of run (s)")
    top.set_title("Admission over time (from admin /stats)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(f"{prefix}_timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
