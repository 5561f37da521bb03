"""A progress display with rich on a terminal; nothing when the output is not a TTY."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from .runner import Progress


@contextlib.asynccontextmanager
async def show_progress(progress: Progress, *, enabled: bool | None = None, label: str = "requests"):
    """Refresh a bar from ``progress`` a few times a second while the block runs.

    Polling (rather than a callback per request) keeps the display off the hot path.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield
        return
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar
    except ImportError:
        yield
        return
    bar = Bar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ok {task.fields[ok]}  in flight {task.fields[inflight]}"),
        TimeElapsedColumn(),
        transient=True,
    )
    task = bar.add_task(label, total=progress.total, ok=0, inflight=0)

    async def refresh() -> None:
        while True:
            bar.update(task, completed=progress.done, ok=progress.ok, inflight=progress.sent - progress.done)
            await asyncio.sleep(0.2)

    with bar:
        t = asyncio.get_running_loop().create_task(refresh())
        try:
            yield
        finally:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
