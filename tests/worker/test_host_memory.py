"""The CPU worker's memory habits (``worker.model.host_memory``, ``ModelRunner.warm_up``):
freed activations are reused without page faults, and the warm-up prefill changes
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
# glibc's defaults. 64 MB tensors are mmap-backed by default (a fresh, faulting mapping
# per allocation); kept in the heap they are reused.
FAULTS_PER_REALLOCATION = textwrap.dedent(
    """
    import resource, sys
    import torch
    from worker.model.host_memory import keep_freed_heap
    if sys.argv[1] == "keep":
        assert keep_freed_heap()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)  # 64 MB, allocated, touched, freed
    before = faults()
    for _ in range(5):
        torch.ones(16 << 20)
    print((faults() - before) // 5)
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_REALLOCATION, mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return int(out.stdout.strip())


def test_freed_activations_are_reused_without_page_faults() -> None:
    default, kept = _faults("default"), _faults("keep")
    # 64 MB is 16k pages: glibc's default maps and faults them on every allocation.
    # Kept in the heap they are reused; what still faults (~10 % here) is the host's
    # own reclaim (this machine runs DAMON with a pageout scheme) taking idle pages.
    assert default > 10_000, default
    assert kept < default / 4, (kept, default)


def test_warm_up_leaves_every_later_request_unchanged(tiny_llama: Path) -> None:
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    chunk = SeqChunk(ids, 0, list(range(10)), need_logits=True)
    cold = ModelRunner(tiny_llama, block_size=4, num_blocks=32)
    expected = cold.execute([chunk])
    warmed = ModelRunner(tiny_llama, block_size=4, num_blocks=32)
    assert warmed.warm_up(10_000) == 32 * 4  # capped by the cache
    assert torch.equal(warmed.execute([chunk]), expected)
    assert ModelRunner(tiny_llama, block_size=4, num_blocks=32).warm_up(0) == 0
