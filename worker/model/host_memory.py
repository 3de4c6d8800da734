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
returned. ``one_malloc_arena``, called before the worker's threads start, keeps
the engine's thread on that same heap. glibc only; elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        logger.debug("no mallopt in %s; the allocator keeps its defaults", name)
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt


def one_malloc_arena() -> bool:
    """Makes threads started from now on allocate from the main heap; call it before
    the worker starts its threads. False where that is not glibc.

    glibc gives each new thread an arena of its own, made of 64 MB heaps, and
    unmaps such a heap as soon as all of it is free, whatever ``keep_freed_heap``
    set: the engine's thread then faults its activations in again. On a Zen 4
    EPYC, three runs of eight cold 2,048-token SmolLM2 prefills on the engine's
    thread after the warm-up: 101k-178k page faults in each of the first three
    to five prefills of two runs (3.44-3.52 s against 3.21-3.37 s once they
    stopped); with one arena, 0-386 faults from the first prefill in all three.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_ARENA_MAX, 1))
    if not ok:
        logger.warning("mallopt refused one arena; the engine thread's heaps may be unmapped")
    return ok


def keep_freed_heap() -> bool:
    """Turns off heap trimming and ``mmap``-backed blocks; False where that is not glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_MMAP_MAX, 0))
    if not ok:
        logger.warning("mallopt refused; each long prefill will page-fault its activations")
    return ok
