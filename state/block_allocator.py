"""Reference-counted paged KV-cache blocks with prefix caching (host side, plain Python).

The paged cache holds `num_blocks` blocks of `block_size` token slots. Block 0 is
the scratch block: padded rows of a batch write their (ignored) KV there, so it
is never handed out and never appears in a real block table. Usable blocks are
1 .. num_blocks - 1.

Every usable block is in exactly one of three places:

* free:      holds nothing anyone may reuse; handed out first;
* evictable: refcount 0 but registered in the prefix cache, so a later request
             with the same prefix can take it back; evicted least recently
             released first when a fresh block is needed;
* owned:     refcount > 0 (several sequences may share a cached prefix block).

A full block is identified by its content hash: the hash of its parent block's
hash and its own token ids, so equal hashes mean equal whole prefixes.

Ownership: one `BlockAllocator` belongs to one `Scheduler`, which is its only
caller; it is a mutable object and not thread safe.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

SCRATCH_BLOCK = 0

BlockHash = bytes


class OutOfBlocks(RuntimeError):
    """Raised by `BlockAllocator.allocate` when fewer blocks are available than asked for."""


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Content hash of one full block: H(parent block's hash, this block's token ids).

    `parent_hash` is None for the first block of a sequence. 128-bit BLAKE2b, so
    two different prefixes colliding is not a practical concern.
    """
    h = hashlib.blake2b(digest_size=16)
    # A fixed-length marker keeps "no parent" distinct from any real 16-byte parent hash.
    h.update(parent_hash if parent_hash is not None else b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_chain(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The content hashes of every full block of `token_ids` (len // block_size of them), chained."""
    out: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached full blocks found for a token sequence, owned by the caller.

    blocks: physical block ids covering positions [0, len(blocks) * block_size).
    hashes: the content hash of each of those blocks, in the same order, so the
            caller can keep chaining hashes for the blocks it fills next.
    """

    blocks: tuple[int, ...]
    hashes: tuple[BlockHash, ...]


class BlockAllocator:
    """Hands out KV-cache blocks, counts their owners and caches full prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the scratch block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Low ids first: handing out in a fixed order keeps runs reproducible.
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._refcount: dict[int, int] = {}  # owned blocks only
        self._hash_of: dict[int, BlockHash] = {}  # registered blocks (owned or evictable)
        self._block_of: dict[BlockHash, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def refcount(self, block: int) -> int:
        return self._refcount.get(block, 0)

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks (refcount 1 each); all or nothing.

        Free blocks go first; then evictable cached blocks, least recently
        released first, lose their cache entry and are reused.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_free_blocks:
            raise OutOfBlocks(
                f"asked for {n} blocks, only {self.num_free_blocks} of "
                f"{self.num_usable_blocks} usable blocks are available"
            )
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refcount[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; all or nothing.

        Blocks are released last to first, so when a sequence's blocks become
        evictable its later blocks are evicted before its earlier ones (a later
        block is useless to a new request without the blocks before it).
        Raises ValueError on the scratch block, an unknown id, or a block that
        would be freed more often than it is owned (a double free).
        """
        blocks = list(blocks)
        for block, times in Counter(blocks).items():
            if block == SCRATCH_BLOCK:
                raise ValueError("block 0 is the scratch block; it is never allocated, so it cannot be freed")
            if self._refcount.get(block, 0) < times:
                raise ValueError(
                    f"double free of block {block}: freed {times} time(s), "
                    f"but it has {self._refcount.get(block, 0)} owner(s)"
                )
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                del self._refcount[block]
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Take a reference to the longest chain of cached full blocks that prefixes `token_ids`.

        Only the len(token_ids) // block_size full blocks are looked up. The
        returned blocks are owned by the caller (refcount + 1), who must `free`
        them like any allocated block.
        """
        if not self.enable_prefix_caching:
            return PrefixHit((), ())
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(len(token_ids) // bs):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        self.take(blocks)
        return PrefixHit(tuple(blocks), tuple(hashes))

    def cached_blocks(self, hashes: Sequence[BlockHash]) -> list[int] | None:
        """The cached block of each content hash, or None unless every one is cached (nothing is taken:
        `take` them to own them)."""
        if not self.enable_prefix_caching:
            return None if hashes else []
        blocks = [self._block_of.get(h) for h in hashes]
        return None if None in blocks else [b for b in blocks if b is not None]

    def take(self, blocks: Iterable[int]) -> None:
        """Take a reference to each cached or owned block (an evictable one leaves the eviction queue)."""
        for block in blocks:
            if block in self._evictable:
                del self._evictable[block]
            elif block not in self._refcount:
                raise ValueError(f"block {block} is neither owned nor cached: it cannot be taken")
            self._refcount[block] = self._refcount.get(block, 0) + 1

    def register(self, block: int, parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
        """Record that owned `block` now holds the full block `token_ids` after `parent_hash`.

        Returns the block's content hash (the parent hash of the next block).
        If another block already caches the same content, that one stays the
        cached copy and `block` remains an ordinary private block.
        """
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"only full blocks are cached: got {len(token_ids)} token ids for block {block}, "
                f"block_size is {self.block_size}"
            )
        if self._refcount.get(block, 0) == 0:
            raise ValueError(f"block {block} is not owned by anyone; only owned blocks can be registered")
        h = hash_block(parent_hash, token_ids)
        if self._hash_of.get(block, h) != h:
            raise ValueError(f"block {block} is already cached with other content; it cannot be registered again")
        if self.enable_prefix_caching and h not in self._block_of:
            self._block_of[h] = block
            self._hash_of[block] = h
        return h

    def check_invariants(self, expected_refcounts: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent.

        Checks that every usable block is in exactly one of free / evictable /
        owned, block 0 is in none, the cache maps are mutual inverses, and
        evictable blocks are cached. With `expected_refcounts` (block -> number
        of owners, as counted by the caller from its own block tables) also
        checks that the owned blocks and their counts match it exactly.
        """
        free, evictable, owned = set(self._free), set(self._evictable), set(self._refcount)
        assert len(free) == len(self._free), "a block appears twice in the free list"
        assert not (free & evictable), f"blocks both free and evictable: {sorted(free & evictable)}"
        assert not (free & owned), f"blocks both free and owned: {sorted(free & owned)}"
        assert not (evictable & owned), f"blocks both evictable and owned: {sorted(evictable & owned)}"
        everything = free | evictable | owned
        usable = set(range(1, self.num_blocks))
        assert everything == usable, (
            f"lost blocks {sorted(usable - everything)}, unknown blocks {sorted(everything - usable)}"
        )
        assert all(c > 0 for c in self._refcount.values()), "an owned block has refcount <= 0"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "cache maps disagree"
        assert len(self._block_of) == len(self._hash_of), "cache maps disagree in size"
        assert evictable <= set(self._hash_of), "an evictable block is not cached"
        assert not (free & set(self._hash_of)), "a free block is still cached"
        if expected_refcounts is not None:
            expected = {b: c for b, c in expected_refcounts.items() if c}
            assert expected == self._refcount, (
                f"refcounts differ from the owners' count: allocator {dict(sorted(self._refcount.items()))}, "
                f"owners {dict(sorted(expected.items()))}"
            )
