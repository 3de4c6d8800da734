"""The CPU worker's memory habits (``worker.model.host_memory``, ``ModelRunner.warm_up``):
freed activations stay in the heap for reuse, and the warm-up prefill changes
nothing a request can see."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from worker.engine.batch import SeqChunk
from worker.model.runner import ModelRunner

# In a child process: mallopt is process-wide, and pytest's own process should keep
# glibc's defaults. What is checked is the allocator's own account (mallinfo2): a 64 MB
# tensor is an mmap'd block by default (its pages go back to the kernel on free, and the
# next one faults them in again); kept, it comes from the heap and stays there when freed.
# Page-fault counts themselves depend on the host: this one runs DAMON with a pageout
# scheme, which may take idle heap pages whatever the allocator does.
HEAP_ACCOUNT = textwrap.dedent(
    """
    import ctypes, ctypes.util, sys
    import torch
    from worker.model.host_memory import keep_freed_heap

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "keep":
        assert keep_freed_heap()
    x = torch.ones(16 << 20)  # 64 MB
    mapped = libc.mallinfo2().hblkhd
    del x
    print(mapped, libc.mallinfo2().fordblks)
    """
)
MB64 = 64 << 20

# How many arenas hold the heap after a thread allocated and freed a 64 MB tensor,
# read from glibc's own report (malloc_info's XML, one <heap> per arena).
ARENAS_AFTER_A_THREAD = textwrap.dedent(
    """
    import ctypes, ctypes.util, os, sys, tempfile, threading
    import torch
    from worker.model.host_memory import keep_freed_heap, one_malloc_arena

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if sys.argv[1] == "one":
        assert one_malloc_arena()
    assert keep_freed_heap()
    thread = threading.Thread(target=lambda: torch.ones(16 << 20))
    thread.start()
    thread.join()
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    fd, path = tempfile.mkstemp()
    os.close(fd)
    report = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, report)
    libc.fclose(report)
    with open(path) as f:
        print(f.read().count("<heap nr="))
    os.unlink(path)
    """
)


def _child(script: str, mode: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", script, mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout


def _heap_account(mode: str) -> tuple[int, int]:
    """(bytes in mmap'd blocks while the tensor lives, free heap bytes after it is freed)."""
    mapped, free = _child(HEAP_ACCOUNT, mode).split()
    return int(mapped), int(free)


def test_freed_activations_stay_in_the_heap() -> None:
    mapped, free = _heap_account("default")
    assert mapped >= MB64 and free < MB64, (mapped, free)  # glibc maps it, and unmaps it
    mapped, free = _heap_account("keep")
    assert mapped < MB64 and free >= MB64, (mapped, free)  # from the heap, and kept there


def test_threads_allocate_from_one_arena() -> None:
    """The engine's thread gets no arena of its own, whose heaps glibc would unmap."""
    assert int(_child(ARENAS_AFTER_A_THREAD, "default")) >= 2
    assert int(_child(ARENAS_AFTER_A_THREAD, "one")) == 1


def test_warm_up_leaves_every_later_request_unchanged(tiny_llama: Path) -> None:
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    chunk = SeqChunk(ids, 0, list(range(10)), need_logits=True)
    cold = ModelRunner(tiny_llama, block_size=4, num_blocks=32)
    expected = cold.execute([chunk])
    warmed = ModelRunner(tiny_llama, block_size=4, num_blocks=32)
    assert warmed.warm_up(10_000) == 32 * 4  # capped by the cache
    assert torch.equal(warmed.execute([chunk]), expected)
    assert ModelRunner(tiny_llama, block_size=4, num_blocks=32).warm_up(0) == 0
