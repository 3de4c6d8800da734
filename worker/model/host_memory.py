"""A CPU worker keeps the memory its steps free, so a step never waits on page faults.

Torch on CPU allocates every activation with plain ``malloc``. glibc hands
large blocks back to the kernel when they are freed (``mmap`` for big ones,
heap trimming for the rest), so the next step's activations arrive as fresh,
zero-filled pages: a 2,048-token SmolLM2 prefill took 90k-230k minor faults
(0.4-0.9 GB) each time, 0.3-0.8 s of a 2.6 s prefill, and more the first
time. With trimming off and no ``mmap`` blocks, freed memory stays in the heap
and the same step reuses it: 0 faults from the second prefill on, and the
worker's first warm-up prefill (``ModelRunner.warm_up``) takes the first.

The cost is that the worker's resident memory stays at its high-water mark,
which a dedicated inference process reaches again on its next long prefill
anyway. Called after the model is loaded, so load-time buffers are still
returned. glibc only; elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_heap() -> bool:
    """Turns off heap trimming and ``mmap``-backed blocks; False where that is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.debug("no mallopt in %s; freed memory goes back to the OS as usual", name)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_MMAP_MAX, 0))
    if not ok:
        logger.warning("mallopt refused; each long prefill will page-fault its activations")
    return ok
