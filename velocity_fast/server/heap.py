"""Keep freed request bodies in the process heap instead of handing them back to the kernel.

A request body is one allocation of its size (the server reads it straight into place),
freed when the exchange ends. glibc's malloc serves an allocation past its mmap
threshold (128 KiB at first) with a fresh mapping and unmaps it on free, and trims the
top of the heap once more than its trim threshold lies free there. Under a steady load of
large prompts either way turns every body into page faults: at 256 KiB prompts the
gateway spent about 5 % of its CPU in the kernel faulting in zeroed pages (``perf``:
``exc_page_fault``, ``clear_page``, ``brk``), about 40 faults a request.

``keep_freed_memory`` raises both thresholds once at start: allocations up to
``MMAP_THRESHOLD`` come from the heap and are reused, and up to ``TRIM_THRESHOLD`` of
free memory stays mapped. The process then keeps what its busiest moment needed (64
bodies of 256 KiB in flight: 16 MiB), as servers with their own allocators do; memory
does not grow past that peak. Only glibc is tuned; elsewhere this does nothing. A
``MALLOC_*_`` or ``GLIBC_TUNABLES`` variable in the environment is the operator's
choice and is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

#: Bodies up to this size come from the heap (glibc's ceiling for the setting on 64-bit:
#: larger values are refused), which covers the default body limit (16 MiB).
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the heap's top kept mapped before glibc trims it.
TRIM_THRESHOLD = 128 * 1024 * 1024

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_OPERATOR_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_freed_memory(environ: dict | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds (see the module's text); True when set.

    False, changing nothing, off glibc or where the environment already tunes malloc.
    """
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in _OPERATOR_VARS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl has no such thresholds
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
