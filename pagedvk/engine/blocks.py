"""Block bookkeeping for a paged KV cache, as vLLM's block manager: per-sequence block tables over a pool of
physical blocks, reference-counted sharing (fork, prefix caching), copy-on-write and swapping to host blocks.

Nothing here touches a cache: every call returns the writes and copies the caller must perform
(reshape_and_cache for slots, copy_blocks for copy-on-write, swap_blocks for swapping). A slot is
block * block_size + offset. Every call either succeeds whole or raises and changes nothing.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..errors import NoFreeBlocksError

TOKEN_MAX = 2**63 - 1   # token ids are hashed as int64


@dataclass
class Writes:
    """What the caller must do after an allocating call.

    slots   int32 [n]: the cache slot of each token to write, in token order (the first `num_cached` tokens of
            a new sequence are already in the cache and get no slot).
    copies  (src block, dst block) pairs to copy before writing (copy-on-write).
    num_cached  tokens found in the prefix cache (add_sequence only).
    """
    slots: np.ndarray
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_cached: int = 0


@dataclass
class _Seq:
    tokens: list[int]
    table: list[int]            # physical blocks (device, or host while swapped)
    hashes: list[bytes]         # prefix hash of each full block, in order
    swapped: bool = False


class _Pool:
    """Reference counts over num_blocks blocks; free blocks kept in LRU order (oldest first), and with prefix
    caching a free block that holds a full hashed block stays findable until it is handed out again."""

    def __init__(self, num_blocks: int):
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}          # prefix hash -> block
        self.hash_of: dict[int, bytes] = {}         # block -> prefix hash

    def take(self) -> int:
        block, _ = self.free.popitem(last=False)    # least recently freed: LRU eviction of cached blocks
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.cached[h]
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

    def remember(self, block: int, h: bytes) -> None:
        if h not in self.cached and block not in self.hash_of:
            self.cached[h], self.hash_of[block] = block, h


def _check_count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


class BlockManager:
    """Block tables for sequences over `num_blocks` device blocks of `block_size` tokens and `num_host_blocks`
    host blocks (the swap space).

    >>> m = BlockManager(num_blocks=8, block_size=4)
    >>> m.add_sequence(0, [1, 2, 3, 4, 5]).slots.tolist()      # tokens 0..4 -> slots in two blocks
    [0, 1, 2, 3, 4]
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, prefix_caching: bool = True):
        self.num_blocks = _check_count("num_blocks", num_blocks, 1)
        self.block_size = _check_count("block_size", block_size, 1)
        self.num_host_blocks = _check_count("num_host_blocks", num_host_blocks, 0)
        self.prefix_caching = bool(prefix_caching)
        self.device, self.host = _Pool(self.num_blocks), _Pool(self.num_host_blocks)
        self.seqs: dict[object, _Seq] = {}
        self.stats = {"prefix_hit_blocks": 0, "forks": 0, "cow_copies": 0, "swapped_out_blocks": 0,
                      "swapped_in_blocks": 0}

    # -- queries -------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Device blocks that can be handed out, cached-but-unused ones included."""
        return len(self.device.free)

    def seq_len(self, seq_id) -> int:
        return len(self._seq(seq_id).tokens)

    def tokens(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).tokens)

    def block_table(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).table)

    def is_swapped(self, seq_id) -> bool:
        return self._seq(seq_id).swapped

    def block_tables(self, seq_ids, max_blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(block_tables int32 [num_seqs, max_blocks], seq_lens int32 [num_seqs]) for a decode plan or prefill;
        entries past a sequence's last block are -1."""
        seqs = [self._resident(s, "seq_ids") for s in seq_ids]
        width = max([len(s.table) for s in seqs] + [1])
        if max_blocks is not None:
            if _check_count("max_blocks", max_blocks, 1) < width:
                raise ValueError(f"max_blocks must be >= {width} (the longest table), got {max_blocks}")
            width = max_blocks
        tables = np.full((len(seqs), width), -1, np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.table)] = s.table
        return tables, np.array([len(s.tokens) for s in seqs], np.int32)

    def cached_prefix(self, tokens) -> tuple[int, int]:
        """What add_sequence(seq_id, tokens) would find in the prefix cache, without taking anything: (tokens
        cached, a multiple of block_size; how many of the hit blocks are free, cached but unused, which sharing
        them takes out of num_free_blocks). An engine that prefills a prompt in chunks sizes its first chunk
        with it: the chunk starts after the cached tokens and its blocks come from what the hits leave free."""
        hits = self._prefix_hits(self._check_tokens(tokens, "tokens", allow_empty=False))
        return len(hits) * self.block_size, sum(self.device.refs[b] == 0 for b in hits)

    def blocks_to_append(self, seq_id, num_tokens: int) -> int:
        """Device blocks append_tokens(seq_id, num_tokens tokens) would take (copy-on-write included)."""
        s = self._resident(seq_id, "seq_id")
        n = _check_count("num_tokens", num_tokens, 0)
        return self._append_plan(s, n)[0]

    # -- operations ----------------------------------------------------------------------------------------

    def add_sequence(self, seq_id, tokens) -> Writes:
        """Start a sequence with its prompt. Full prompt blocks whose prefix hash is cached are shared (never
        the block holding the last token, whose logits the caller must compute); `num_cached` tokens are
        already in the cache and `slots` covers the rest."""
        if seq_id in self.seqs:
            raise ValueError(f"seq_id {seq_id!r} is already in use")
        tokens = self._check_tokens(tokens, "tokens", allow_empty=False)
        bs = self.block_size
        hashes = self._hashes(b"", tokens)
        hits = self._prefix_hits(tokens, hashes)
        need = -(-len(tokens) // bs) - len(hits)
        if need + sum(self.device.refs[b] == 0 for b in hits) > self.num_free_blocks:
            raise NoFreeBlocksError(f"add_sequence({seq_id!r}) needs {need} free blocks besides "
                                    f"{len(hits)} prefix hits; {self.num_free_blocks} free")
        for b in hits:
            self.device.share(b)
        table = hits + [self.device.take() for _ in range(need)]
        seq = self.seqs[seq_id] = _Seq(list(tokens), table, [])
        self._register_full_blocks(seq, hashes)
        self.stats["prefix_hit_blocks"] += len(hits)
        cached = len(hits) * bs
        return Writes(self._slots(table, cached, len(tokens)), [], cached)

    def append_tokens(self, seq_id, tokens) -> Writes:
        """Add tokens to a sequence; returns their slots and, when its last block is shared (after a fork),
        the copy-on-write (src, dst) the caller must perform before writing."""
        s = self._resident(seq_id, "seq_id")
        tokens = self._check_tokens(tokens, "tokens", allow_empty=True)
        need, cow = self._append_plan(s, len(tokens))
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"append_tokens({seq_id!r}, {len(tokens)} tokens) needs {need} free blocks; "
                                    f"{self.num_free_blocks} free")
        # Everything that can fail is done before the first change (the hashes among it), so a failure changes
        # nothing: a late failure once kept the copy-on-write block taken and its copy pair lost.
        start = len(s.tokens)
        parent = s.hashes[-1] if s.hashes else b""
        hashes = s.hashes + self._hashes(parent, (s.tokens + tokens)[len(s.hashes) * self.block_size:])
        copies = []
        if cow:
            src, dst = s.table[-1], self.device.take()
            self.device.release(src)
            s.table[-1] = dst
            copies.append((src, dst))
            self.stats["cow_copies"] += 1
        s.tokens.extend(tokens)
        s.table.extend(self.device.take() for _ in range(need - cow))
        self._register_full_blocks(s, hashes)
        return Writes(self._slots(s.table, start, len(s.tokens)), copies)

    def fork(self, parent_id, child_id) -> None:
        """A child sharing every block of its parent (parallel sampling); the first write into a shared
        partial block copies it."""
        p = self._resident(parent_id, "parent_id")
        if child_id in self.seqs:
            raise ValueError(f"child_id {child_id!r} is already in use")
        for b in p.table:
            self.device.share(b)
        self.seqs[child_id] = _Seq(list(p.tokens), list(p.table), list(p.hashes))
        self.stats["forks"] += 1

    def free(self, seq_id) -> None:
        """Drop a sequence (resident or swapped). Its full blocks stay in the prefix cache until reused."""
        s = self._seq(seq_id)
        pool = self.host if s.swapped else self.device
        for b in reversed(s.table):     # tail first, so a prefix's first block is evicted last
            pool.release(b)
        del self.seqs[seq_id]

    def swap_out(self, seq_ids) -> list[tuple[int, int]]:
        """Move sequences (a forked group together, so shared blocks stay shared) to host blocks; returns the
        (device block, host block) pairs the caller must copy with swap_blocks before reusing the device
        blocks."""
        seqs = self._distinct(seq_ids, swapped=False)
        uses = Counter(b for s in seqs for b in s.table)
        if len(uses) > len(self.host.free):
            raise NoFreeBlocksError(f"swap_out needs {len(uses)} free host blocks; {len(self.host.free)} free")
        to_host = {b: self.host.take() for b in uses}
        for b, n in uses.items():       # one reference per table entry, as on the device
            self.host.refs[to_host[b]] = n
        self._move(seqs, self.device, to_host, swapped=True)
        self.stats["swapped_out_blocks"] += len(uses)
        return list(to_host.items())

    def swap_in(self, seq_ids) -> list[tuple[int, int]]:
        """Bring swapped sequences back; returns the (host block, device block) pairs the caller must copy with
        swap_blocks. A full block still in the prefix cache is shared instead of copied."""
        seqs = self._distinct(seq_ids, swapped=True)
        uses = Counter(b for s in seqs for b in s.table)
        hash_of = {s.table[i]: h for s in seqs for i, h in enumerate(s.hashes)}
        hits = {b: self.device.cached[hash_of[b]] for b in uses
                if self.prefix_caching and hash_of.get(b) in self.device.cached}
        need = len(uses) - len(hits) + sum(self.device.refs[d] == 0 for d in set(hits.values()))
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"swap_in needs {need} free blocks; {self.num_free_blocks} free")
        for b, d in hits.items():       # pinned before take() below could evict them
            for _ in range(uses[b]):
                self.device.share(d)
        to_dev, copies = dict(hits), []
        for b, n in uses.items():
            if b not in hits:
                to_dev[b] = self.device.take()
                self.device.refs[to_dev[b]] = n
                copies.append((b, to_dev[b]))
        self._move(seqs, self.host, to_dev, swapped=False)
        for s in seqs:
            self._register_full_blocks(s, s.hashes)
        self.stats["prefix_hit_blocks"] += len(hits)
        self.stats["swapped_in_blocks"] += len(copies)
        return copies

    # -- internals -----------------------------------------------------------------------------------------

    @staticmethod
    def _move(seqs: list[_Seq], source: _Pool, mapping: dict[int, int], swapped: bool) -> None:
        """Point every table entry at its new block (whose references the caller has set) and drop the
        reference each entry held in `source`."""
        for s in seqs:
            for i, b in enumerate(s.table):
                source.release(b)
                s.table[i] = mapping[b]
            s.swapped = swapped

    def _seq(self, seq_id) -> _Seq:
        try:
            return self.seqs[seq_id]
        except (KeyError, TypeError):
            raise ValueError(f"seq_id {seq_id!r} is not a sequence of this manager") from None

    def _resident(self, seq_id, name: str) -> _Seq:
        if seq_id not in self.seqs:
            raise ValueError(f"{name} {seq_id!r} is not a sequence of this manager")
        s = self.seqs[seq_id]
        if s.swapped:
            raise ValueError(f"{name} {seq_id!r} is swapped out; swap_in first")
        return s

    def _distinct(self, seq_ids, swapped: bool) -> list[_Seq]:
        ids = list(seq_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be a non-empty list of distinct sequences, got {ids!r}")
        seqs = [self._seq(i) for i in ids]
        for i, s in zip(ids, seqs):
            if s.swapped != swapped:
                raise ValueError(f"seq_ids: {i!r} is {'resident' if swapped else 'already swapped out'}")
        return seqs

    @staticmethod
    def _check_tokens(tokens, name: str, allow_empty: bool) -> list[int]:
        if isinstance(tokens, (list, tuple)) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                     for t in tokens):
            values = [int(t) for t in tokens]   # numpy would make [5, 2**63] float64
        else:
            arr = np.asarray(tokens)
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise TypeError(f"{name} must be a 1-d sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
            values = [int(t) for t in arr]
        if not allow_empty and not values:
            raise ValueError(f"{name} must hold at least 1 token")
        if values and min(values) < 0:
            raise ValueError(f"{name} must be >= 0, got {min(values)}")
        if values and max(values) > TOKEN_MAX:   # ids past int64 would not hash (_hashes packs int64)
            raise ValueError(f"{name} must be <= {TOKEN_MAX} (2^63 - 1), got {max(values)}")
        return values

    def _append_plan(self, s: _Seq, n: int) -> tuple[int, bool]:
        """(device blocks needed, whether the partial last block is shared and must be copied first)."""
        bs = self.block_size
        room = len(s.table) * bs - len(s.tokens)
        cow = n > 0 and room > 0 and self.device.refs[s.table[-1]] > 1
        return -(-max(n - room, 0) // bs) + cow, cow

    def _prefix_hits(self, tokens: list[int], hashes: list[bytes] | None = None) -> list[int]:
        """The cached blocks a new sequence of `tokens` shares: its leading full blocks found by prefix hash, never
        the block holding its last token (whose logits the caller must compute)."""
        if not self.prefix_caching:
            return []
        hits = []
        for h in (hashes if hashes is not None else self._hashes(b"", tokens))[:(len(tokens) - 1) // self.block_size]:
            block = self.device.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _hashes(self, parent: bytes, tokens: list[int]) -> list[bytes]:
        """Prefix hash of each full block of `tokens`: sha256(parent hash + the block's tokens)."""
        out, bs = [], self.block_size
        for i in range(len(tokens) // bs):
            parent = hashlib.sha256(parent + np.asarray(tokens[i * bs:(i + 1) * bs], np.int64).tobytes()).digest()
            out.append(parent)
        return out

    def _register_full_blocks(self, s: _Seq, hashes: list[bytes]) -> None:
        s.hashes = hashes
        if self.prefix_caching:
            for b, h in zip(s.table, hashes):
                self.device.remember(b, h)

    def _slots(self, table: list[int], start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop)
        return (np.asarray(table, np.int64)[pos // self.block_size] * self.block_size
                + pos % self.block_size).astype(np.int32)
