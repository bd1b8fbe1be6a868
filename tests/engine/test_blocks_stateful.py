"""The block manager under random operation sequences (hypothesis stateful): after every step no block is
leaked or freed twice, reference counts equal the table entries holding each block, no shared block is
written, and every token's slot holds that token's contents in a shadow cache, whatever prefix hits,
copy-on-write and swapping happened on the way."""

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedvk.engine.blocks import BlockManager
from pagedvk.errors import NoFreeBlocksError

# Prompts from a tiny alphabet with common beginnings, so prefix hits happen often.
PREFIXES = [[], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 7, 7, 7]]
tokens = st.lists(st.integers(0, 3), min_size=0, max_size=9)


class BlockMachine(RuleBasedStateMachine):

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 14),
                num_host_blocks=st.integers(0, 16), prefix_caching=st.booleans())
    def setup(self, block_size, num_blocks, num_host_blocks, prefix_caching):
        self.m = BlockManager(num_blocks, block_size, num_host_blocks, prefix_caching)
        self.dev, self.host = {}, {}     # shadow caches: slot -> contents (the token prefix it encodes)
        self.next_id = 0

    # -- helpers ------------------------------------------------------------------------------------------

    def resident(self):
        return sorted(i for i, s in self.m.seqs.items() if not s.swapped)

    def swapped(self):
        return sorted(i for i, s in self.m.seqs.items() if s.swapped)

    def state(self):
        return copy.deepcopy((self.m.device.__dict__, self.m.host.__dict__, self.m.seqs))

    def attempt(self, call):
        """Run call(); if it runs out of blocks, nothing may have changed."""
        before = self.state()
        try:
            return call()
        except NoFreeBlocksError:
            assert self.state() == before, "a failed call changed the manager"
            return None

    def write(self, seq_id, writes, start):
        bs, toks = self.m.block_size, self.m.tokens(seq_id)
        for src, dst in writes.copies:
            assert self.m.device.refs[src] >= 1 and self.m.device.refs[dst] == 1
            for o in range(bs):
                self.dev[dst * bs + o] = self.dev.get(src * bs + o)
        assert len(writes.slots) == len(toks) - start
        for pos, slot in enumerate(writes.slots.tolist(), start):
            assert self.m.device.refs[slot // bs] == 1, f"slot {slot} is in a shared block"
            self.dev[slot] = tuple(toks[:pos + 1])

    def move(self, pairs, src, dst):
        bs = self.m.block_size
        for a, b in pairs:
            for o in range(bs):
                dst[b * bs + o] = src.get(a * bs + o)

    # -- rules --------------------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), rest=tokens)
    def add(self, prefix, rest):
        prompt = prefix + rest or [0]
        seq_id, self.next_id = self.next_id, self.next_id + 1
        w = self.attempt(lambda: self.m.add_sequence(seq_id, prompt))
        if w is not None:
            assert w.num_cached % self.m.block_size == 0 and w.num_cached < len(prompt)
            self.write(seq_id, w, w.num_cached)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), new=tokens)
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(self.resident()))
        start = self.m.seq_len(seq_id)
        need = self.m.blocks_to_append(seq_id, len(new))
        free = self.m.num_free_blocks
        w = self.attempt(lambda: self.m.append_tokens(seq_id, new))
        assert (w is None) == (need > free)
        if w is not None:
            self.write(seq_id, w, start)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.resident()))
        self.m.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.m.seqs)
    @rule(data=st.data())
    def free(self, data):
        self.m.free(data.draw(st.sampled_from(sorted(self.m.seqs))))

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        before = {i: self.m.tokens(i) for i in ids}
        pairs = self.attempt(lambda: self.m.swap_out(ids))
        if pairs is not None:
            assert len({d for d, _ in pairs}) == len(pairs) == len({h for _, h in pairs})
            self.move(pairs, self.dev, self.host)
            assert {i: self.m.tokens(i) for i in ids} == before

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.swapped()), min_size=1, unique=True))
        pairs = self.attempt(lambda: self.m.swap_in(ids))
        if pairs is not None:
            self.move(pairs, self.host, self.dev)

    # -- invariants ---------------------------------------------------------------------------------------

    @invariant()
    def references_match_tables(self):
        for pool, swapped in ((self.m.device, False), (self.m.host, True)):
            held = [0] * len(pool.refs)
            for s in self.m.seqs.values():
                if s.swapped == swapped:
                    for b in s.table:
                        held[b] += 1
            assert pool.refs == held, "reference counts differ from the tables"
            assert set(pool.free) == {b for b, r in enumerate(pool.refs) if r == 0}, "a block leaked"
            assert all(pool.hash_of[b] == h for h, b in pool.cached.items())
            assert len(pool.cached) == len(pool.hash_of)

    @invariant()
    def contents_are_each_tokens_prefix(self):
        bs = self.m.block_size
        for seq_id, s in self.m.seqs.items():
            assert len(s.table) == -(-len(s.tokens) // bs)
            cache = self.host if s.swapped else self.dev
            for pos in range(len(s.tokens)):
                slot = s.table[pos // bs] * bs + pos % bs
                assert cache.get(slot) == tuple(s.tokens[:pos + 1]), f"seq {seq_id} token {pos} reads wrong data"

    @invariant()
    def cached_blocks_hold_their_prefix(self):
        bs = self.m.block_size
        for s in self.m.seqs.values():
            if not s.swapped:
                for i, h in enumerate(s.hashes[:len(s.table)]):
                    b = self.m.device.cached.get(h)
                    if b is not None:
                        assert self.dev.get(b * bs + bs - 1) == tuple(s.tokens[:(i + 1) * bs])


BlockMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestBlockMachine = BlockMachine.TestCase
