"""The one block-hash function that workers and gateways must compute identically.

A prompt's KV cache is addressed by a chain of 64-bit hashes, one per *full*
block of ``block_size`` tokens:

    h_0 = xxh3_64(seed_le64 || tokens[0:B] as u32 little-endian)
    h_i = xxh3_64(h_{i-1}_le64 || tokens[iB:(i+1)B] as u32 little-endian)

``seed`` folds in everything that changes the KV values (model identity and
revision, LoRA adapter, the tenant's cache salt) plus the block size, so two
specs that may not share KV can never produce the same chain. A trailing
partial block is never hashed. Changing anything here is a deliberate,
fleet-wide break: the golden vectors in ``tests/contract/test_hashing.py`` fail.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from contract.prompt_wire import le32

HASH_VERSION = "kvroute-block-hash-v1"
MAX_TOKEN_ID = 2**32 - 1
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class HashSpec:
    """Everything that determines a block's hash besides its tokens."""

    block_size: int = 16
    model: str = ""
    revision: str = ""
    lora: str = ""
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")

    def with_salt(self, cache_salt: str) -> HashSpec:
        """The same spec for another tenant (or none, with ``""``)."""
        return self if cache_salt == self.cache_salt else replace(self, cache_salt=cache_salt)

    def with_lora(self, lora: str) -> HashSpec:
        """The same spec for another LoRA adapter (``""`` for the base model)."""
        return self if lora == self.lora else replace(self, lora=lora)

    @property
    def seed(self) -> int:
        """The parent value of block 0: a hash of the spec's identity fields.

        Fields are length-prefixed so that ("ab", "c") and ("a", "bc") differ.
        """
        parts = [
            HASH_VERSION,
            str(self.block_size),
            self.model,
            self.revision,
            self.lora,
            self.cache_salt,
        ]
        buf = bytearray()
        for part in parts:
            raw = part.encode("utf-8")
            buf += _U64.pack(len(raw)) + raw
        return xxhash.xxh3_64_intdigest(bytes(buf))

    def describe(self) -> dict[str, str | int]:
        """The spec without the tenant salt, as workers advertise it in the registry."""
        return {
            "version": HASH_VERSION,
            "block_size": self.block_size,
            "model": self.model,
            "revision": self.revision,
            "lora": self.lora,
        }


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The token ids as little-endian u32s, the bytes every block hash is taken over."""
    if not isinstance(token_ids, np.ndarray):
        # A list straight into a C array, the prompt's wire bytes: a 6k-token prompt in
        # 36 us against 110 through numpy (int64 array, range check, cast; python -m
        # timeit, best of 5); the C conversion checks the range.
        try:
            return le32(token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in [0, 2**32)") from None
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError("token_ids must be a flat sequence of integers")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def extend_block_hashes(
    existing: Sequence[int], token_ids: Sequence[int] | np.ndarray, spec: HashSpec
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` past the ``len(existing)`` already hashed.

    ``existing`` must be the chain of the first ``len(existing)`` blocks of the
    same token ids under the same spec; only the new blocks are hashed, so a
    growing sequence (or a multi-turn chat) never rehashes its prefix. Returns
    only the new hashes.
    """
    bs = spec.block_size
    n_full = len(token_ids) // bs
    start = len(existing)
    if start > n_full:
        raise ValueError("existing chain is longer than the token ids allow")
    if start == n_full:
        return []
    data = _token_bytes(token_ids[start * bs : n_full * bs])
    parent = existing[-1] if existing else spec.seed
    step = bs * 4
    out: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    pack = _U64.pack
    for off in range(0, len(data), step):
        parent = digest(pack(parent) + data[off : off + step])
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int] | np.ndarray, spec: HashSpec) -> list[int]:
    """The chain hashes of every full block of ``token_ids`` under ``spec``."""
    return extend_block_hashes((), token_ids, spec)


def block_hash(parent: int, block_token_ids: Sequence[int], spec: HashSpec) -> int:
    """The hash of one full block after ``parent`` (``spec.seed`` for block 0)."""
    if len(block_token_ids) != spec.block_size:
        raise ValueError(
            f"a block holds exactly {spec.block_size} tokens, got {len(block_token_ids)}"
        )
    return xxhash.xxh3_64_intdigest(_U64.pack(parent) + _token_bytes(block_token_ids))
