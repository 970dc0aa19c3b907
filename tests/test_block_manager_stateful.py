"""Random operation sequences against `BlockManager`, checked against a shadow device.

The shadow keeps every sequence's tokens and computed count, and simulates the pages: a write of
position ``p`` of a sequence stamps ``(salt, tokens[:p + 1])`` into its slot (KV depends on the whole
prefix, so a block with the right tokens after the wrong parent carries a different stamp). Copies
returned by the manager are applied when the next step launches, in a random order of the three
kinds (CoW, swap-out, swap-in) because the manager promises they do not depend on one another; pages
given to ``on_free`` are poisoned at once. After every rule:

* ``check_invariants()`` (partition of blocks, refcounts = table references, no stale cache entry);
* every cached block holds exactly the stamps of its key's token chain and salt;
* at each launch, every resident sequence reads exactly its own stamps at every position, a written
  block is never shared or keyed, and at each completion the computed prefix is verified again;
* a block handed out fresh was not read by a step still in flight, has no pending copy and waited
  out the quarantine window; pages reported to ``on_free`` are referenced by nobody.

A deliberately weak hash (two buckets) makes every lookup go through full-key verification.
"""

from __future__ import annotations

import os
from collections import Counter, deque

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from paged.kv.block_manager import BlockManager

B = 4
POISON = "poison"
_BASES = (
    (0, 1, 0, 1, 2, 0, 1, 0, 2, 2, 1, 0, 1, 1),
    (0, 1, 0, 1, 1, 1, 0, 0, 2, 2, 1, 0, 0, 2),  # same first block, then diverges
    (2, 0, 1, 0, 2, 0, 1, 0, 2, 2, 1, 0, 1, 1),  # block 1 and 2 tokens of base 0, other parent
)
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=5)
_ACTIONS = (
    ["allocate"] * 5 + ["append"] * 3 + ["decode"] * 3 + ["lookahead"] * 2 + ["rollback"] * 2
    + ["fork"] * 3
    + ["free"] * 3 + ["evict"] + ["swap_out"] * 2 + ["swap_in"] * 2 + ["launch"] * 4
    + ["complete"] * 4 + ["sync"] * 4 + ["misuse"] + ["set_tokens"] * 3)


class BlockManagerMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 20
    NUM_HOST = 8
    QUARANTINE_STEPS = 1
    HASH_FN = staticmethod(lambda parent, ids, salt: ids[0] % 2)
    MAX_SEQS = 7
    EVICTION = "lru"  # prefix_eviction (tests/test_eviction_policies.py runs every policy)
    rules_run = 0

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(
            self.NUM_BLOCKS, B, cache_salt=b"model", hash_fn=self.HASH_FN,
            quarantine_steps=self.QUARANTINE_STEPS, num_host_blocks=self.NUM_HOST,
            on_free=self._on_free, prefix_eviction=self.EVICTION)
        self.tokens: dict[int, list] = {}
        self.computed: dict[int, int] = {}
        self.salt: dict[int, bytes] = {}
        self.hidden: dict[int, dict[int, int]] = {}  # seq -> {slot: token id the manager lacks}
        self.next_id = 0
        self.pages = [[None] * B for _ in range(self.NUM_BLOCKS)]
        self.host = [[None] * B for _ in range(self.NUM_HOST)]
        self.pending = {"cow": [], "out": [], "in": []}
        self.inflight: deque = deque()  # (step id, blocks it reads, {seq: computed target})
        self.busy: dict[int, int] = {}  # block -> step performing a copy that touches it
        self.host_busy: dict[int, int] = {}
        self.release_at: dict[int, int] = {}  # block -> step that must complete before reuse
        self.died: list[int] = []
        self.refs = Counter()
        self.history: list[tuple[int, ...]] = []
        self.swapped_in_round: set[int] = set()  # since the last launch
        self.swapped_out_round: set[int] = set()

    # --- helpers ------------------------------------------------------------------------------
    def _on_free(self, blocks):
        for b in blocks:
            assert self.busy.get(b, -1) <= self.bm.last_completed_step, f"{b} has a pending copy"
            if self.QUARANTINE_STEPS:
                assert all(b not in reads for _, reads, _ in self.inflight), (
                    f"block {b} freed to reuse while an in-flight step reads it")
            self.pages[b] = [POISON] * B
        self.died.extend(blocks)

    def _stamp(self, sid, p):
        return (self.salt[sid], tuple(self.tokens[sid][:p + 1]))

    def _resident(self):
        return sorted(s for s in self.tokens if not self.bm.is_swapped(s))

    def _count_refs(self):
        return Counter(b for s in self._resident() for b in self.bm.block_table(s))

    def _after_op(self, fresh=(), hits=()):
        """Checks blocks handed out by the op and records blocks that lost their last reference."""
        refs = self._count_refs()
        nxt = self.bm.last_begun_step + 1
        done = self.bm.last_completed_step
        for b in refs:
            if b in self.refs or b in hits:
                continue
            assert b in fresh, f"block {b} appeared in a table without being handed out"
        for b in fresh:
            assert refs[b] == 1 and self.bm.refcount(b) == 1
            assert self.refs[b] == 0, f"fresh block {b} was still referenced"
            assert self.busy.get(b, -1) <= done, f"fresh block {b} has a pending copy"
            assert self.release_at.get(b, -1) <= done, (
                f"block {b} reused before step {self.release_at[b]} completed (now {done})")
            if self.QUARANTINE_STEPS:
                assert all(b not in reads for _, reads, _ in self.inflight), (
                    f"block {b} handed out while an in-flight step reads it")
        for b in self.refs:
            if refs[b] == 0:  # lost its last reference now
                window = self.bm.last_begun_step + self.QUARANTINE_STEPS - 1
                self.release_at[b] = window if self.QUARANTINE_STEPS else -1
        for b in self.died:
            assert refs[b] == 0 or b in fresh, f"on_free({b}) while it is referenced"
        self.died = []
        self.refs = refs
        del nxt

    def _seq_ids(self, data, pred=lambda s: True):
        ids = [s for s in sorted(self.tokens) if pred(s)]
        return data.draw(st.sampled_from(ids)) if ids else None

    def _max_target(self, sid):
        return max((t[sid] for _, _, t in self.inflight if sid in t), default=0)

    # --- rules --------------------------------------------------------------------------------
    @rule(data=st.data())
    def step(self, data):
        """One operation, drawn with weights (rules are otherwise drawn uniformly)."""
        type(self).rules_run += 1
        action = data.draw(st.sampled_from(_ACTIONS), label="action")
        getattr(self, action)(data)

    def allocate(self, data):
        if len(self.tokens) >= self.MAX_SEQS:
            return
        # Half the prompts continue an earlier sequence (a retry or a multi-turn follow-up).
        bases = _BASES + tuple(self.history[-6:]) * 2
        base = data.draw(st.sampled_from(bases), label="base")
        cut = data.draw(st.sampled_from([1, 3, 5, 8, 9, 11, 12, 13, 14, 20]), label="cut")
        suffix = data.draw(st.lists(st.integers(0, 2), max_size=3), label="suffix")
        salt = data.draw(st.sampled_from([None, None, None, "lora"]), label="salt")
        prompt = list(base[:cut]) + suffix
        sid = self.next_id
        self.next_id += 1
        can = self.bm.can_allocate(prompt, cache_salt=salt)
        before = self.bm.num_allocatable_blocks
        hit = self.bm.allocate(sid, prompt, cache_salt=salt)
        assert (hit is not None) == can
        if hit is None:
            assert self.bm.num_allocatable_blocks == before
            self._after_op()
            return
        assert hit % B == 0 and 0 <= hit < len(prompt)
        self.tokens[sid], self.computed[sid] = prompt, hit
        self.history.append(tuple(prompt))
        self.salt[sid] = b"model" if salt is None else salt.encode()
        table = self.bm.block_table(sid)
        assert len(table) == -(-len(prompt) // B)
        for p in range(hit):  # served blocks hold exactly this prompt's KV
            assert self.pages[table[p // B]][p % B] == self._stamp(sid, p)
        self._after_op(fresh=table[hit // B:], hits=table[:hit // B])

    def _grow(self, sid, new, lookahead):
        old = self.bm.block_table(sid)
        need = self.bm.num_slots_needed(sid, len(new))
        free_before = self.bm.num_allocatable_blocks
        if lookahead:
            known = None if any(t is None for t in new) else new
            pairs = self.bm.reserve_lookahead(sid, len(new), known)
        else:
            pairs = self.bm.append_slots(sid, new)
        if pairs is None:
            assert need > free_before and self.bm.block_table(sid) == old
            self._after_op()
            return
        table = self.bm.block_table(sid)
        assert len(table) == -(-(len(self.tokens[sid]) + len(new)) // B)
        assert not old or table[:len(old) - 1] == old[:-1]
        nxt = self.bm.last_begun_step + 1
        fresh = table[len(old):]
        assert len(pairs) <= 1
        for src, dst in pairs:
            assert src == old[-1] and dst == table[len(old) - 1]
            fresh = [dst, *fresh]
        if not pairs and old:
            assert table[len(old) - 1] == old[-1]
        assert need == len(fresh)
        self.tokens[sid] = self.tokens[sid] + new
        self._after_op(fresh=fresh)
        for src, dst in pairs:
            self.pending["cow"].append((src, dst))
            self.busy[src] = self.busy[dst] = nxt

    def append(self, data):
        new = data.draw(TOKENS, label="new")
        sid = self._seq_ids(data, lambda s: not self.bm.is_swapped(s))
        if sid is not None:
            self._grow(sid, new, lookahead=False)

    def decode(self, data):
        """One token for several resident sequences through append_decode_slots."""
        ids = [s for s in self._resident() if data.draw(st.booleans(), label=f"pick {s}")]
        new = [data.draw(st.integers(0, 2), label="token") for _ in ids]
        # Some token ids are not known yet (an overlapped step): set_tokens gives them later.
        hide = [data.draw(st.booleans(), label="hide") for _ in ids]
        old = {s: self.bm.block_table(s) for s in ids}
        copied = Counter()  # exact need: the last sharer of a tail block to write needs no copy
        need = 0
        for s in ids:
            n = len(self.tokens[s])
            if n % B == 0:
                need += 1
            else:
                tail = self.bm.block_table(s)[-1]
                if self.bm.refcount(tail) - copied[tail] > 1:
                    need += 1
                    copied[tail] += 1
        free_before = self.bm.num_allocatable_blocks
        pairs = self.bm.append_decode_slots(ids, [None if h else t for t, h in zip(new, hide)])
        if pairs is None:
            assert need > free_before and all(self.bm.block_table(s) == old[s] for s in ids)
            self._after_op()
            return
        assert len(pairs) <= len(ids)
        fresh = []
        expected = []
        for s, t, h in zip(ids, new, hide, strict=True):
            if h:
                self.hidden.setdefault(s, {})[len(self.tokens[s])] = t
            table = self.bm.block_table(s)
            o = old[s]
            assert table[:len(o) - 1] == o[:-1] and len(table) - len(o) in (0, 1)
            if o and table[len(o) - 1] != o[-1]:
                expected.append((o[-1], table[len(o) - 1]))
                fresh.append(table[len(o) - 1])
            fresh += table[len(o):]
            self.tokens[s] = self.tokens[s] + [t]
        assert pairs == expected and need == len(fresh)
        self._after_op(fresh=fresh)
        nxt = self.bm.last_begun_step + 1
        for src, dst in pairs:
            self.pending["cow"].append((src, dst))
            self.busy[src] = self.busy[dst] = nxt

    def lookahead(self, data):
        k = data.draw(st.integers(1, 5), label="k")
        known = data.draw(st.booleans(), label="known")
        sid = self._seq_ids(data, lambda s: not self.bm.is_swapped(s))
        if sid is not None:
            new = ([None] * k if not known
                   else data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)))
            self._grow(sid, new, lookahead=True)

    def rollback(self, data):
        sid = self._seq_ids(data, lambda s: not self.bm.is_swapped(s))
        if sid is None:
            return
        n = len(self.tokens[sid])
        r = data.draw(st.integers(0, n - self._max_target(sid)))  # never what a step is writing
        old = self.bm.block_table(sid)
        self.bm.rollback(sid, r)
        self.tokens[sid] = self.tokens[sid][:n - r]
        self.computed[sid] = min(self.computed[sid], n - r)
        self.hidden[sid] = {p: t for p, t in self.hidden.get(sid, {}).items() if p < n - r}
        assert self.bm.block_table(sid) == old[:-(-(n - r) // B)]
        assert self.bm.num_computed_tokens(sid) == self.computed[sid]
        self._after_op()

    def fork(self, data):
        if len(self.tokens) >= self.MAX_SEQS:
            return
        sid = self._seq_ids(data, lambda s: not self.bm.is_swapped(s))
        if sid is None:
            return
        child = self.next_id
        self.next_id += 1
        if self.computed[sid] != len(self.tokens[sid]):
            try:
                self.bm.fork(sid, child)
            except ValueError:
                assert not self.bm.has_seq(child)
                return
            raise AssertionError("fork of a sequence with uncomputed slots must raise")
        self.bm.fork(sid, child)
        self.hidden[child] = dict(self.hidden.get(sid, {}))
        for d in (self.tokens, self.computed, self.salt):
            d[child] = list(d[sid]) if isinstance(d[sid], list) else d[sid]
        assert self.bm.block_table(child) == self.bm.block_table(sid)
        self._after_op()

    def free(self, data):
        sid = self._seq_ids(data)
        if sid is None:
            return
        self.bm.free(sid)
        if self.tokens[sid] and None not in self.tokens[sid]:
            self.history.append(tuple(self.tokens[sid]))
        for d in (self.tokens, self.computed, self.salt):
            del d[sid]
        self.hidden.pop(sid, None)
        assert not self.bm.has_seq(sid)
        self._after_op()

    def evict(self, data):
        n = data.draw(st.integers(0, 3), label="n")
        cached = self.bm.evictable_blocks()
        assert self.bm.evict_cached(n) == min(n, len(cached))
        assert self.bm.evictable_blocks() == cached[n:]
        self._after_op()

    def swap_out(self, data):
        sid = self._seq_ids(data, lambda s: not self.bm.is_swapped(s)
                            and all(s not in t for _, _, t in self.inflight))
        if sid is None:
            return
        old = self.bm.block_table(sid)
        swapped_in_now = sid in self.swapped_in_round
        pairs = self.bm.swap_out(sid)
        if pairs is None:
            assert swapped_in_now or self.bm.num_free_host_blocks < len(old)
            assert self.bm.block_table(sid) == old
            return
        assert not swapped_in_now
        cow_src = {dst: src for src, dst in self.pending["cow"]}
        assert [p for p, _ in pairs] == [cow_src.get(b, b) for b in old]
        nxt = self.bm.last_begun_step + 1
        for p, h in pairs:
            assert self.host_busy.get(h, -1) <= self.bm.last_completed_step
            self.busy[p] = self.host_busy[h] = nxt
        self.pending["out"].extend(pairs)
        self.swapped_out_round.add(sid)
        assert self.bm.host_block_table(sid) == [h for _, h in pairs]
        self._after_op()

    def swap_in(self, data):
        sid = self._seq_ids(data, lambda s: self.bm.is_swapped(s))
        if sid is None:
            return
        hosts = self.bm.host_block_table(sid)
        can = self.bm.can_swap_in(sid)
        pairs = self.bm.swap_in(sid)
        assert (pairs is not None) == can
        if pairs is None:
            assert (sid in self.swapped_out_round
                    or len(hosts) > self.bm.num_allocatable_blocks)
            return
        assert sid not in self.swapped_out_round
        self.swapped_in_round.add(sid)
        assert [h for h, _ in pairs] == hosts
        self._after_op(fresh=[p for _, p in pairs])
        nxt = self.bm.last_begun_step + 1
        for h, p in pairs:
            self.busy[p] = self.host_busy[h] = nxt
        self.pending["in"].extend(pairs)

    def launch(self, data):
        if len(self.inflight) >= 2:
            return
        order = data.draw(st.permutations(["cow", "out", "in"]), label="order")
        step = self.bm.begin_step()
        self.swapped_in_round.clear()
        self.swapped_out_round.clear()
        reads = set()
        for kind in order:
            pairs = self.pending[kind]
            if kind == "cow":
                data = [list(self.pages[s]) for s, _ in pairs]  # gather, then scatter
                for (_, d), content in zip(pairs, data, strict=True):
                    self.pages[d] = content
                reads |= {s for s, _ in pairs}
            elif kind == "out":
                for p, h in pairs:
                    self.host[h] = list(self.pages[p])
                reads |= {p for p, _ in pairs}
            else:
                for h, p in pairs:
                    self.pages[p] = list(self.host[h])
            self.pending[kind] = []
        targets = {}
        for sid in self._resident():
            table = self.bm.block_table(sid)
            reads |= set(table)
            for p in range(self.computed[sid], len(self.tokens[sid])):
                b = table[p // B]
                assert self.bm.refcount(b) == 1, f"step writes shared block {b}"
                assert self.bm.block_key(b) is None, f"step writes into cached block {b}"
                self.pages[b][p % B] = self._stamp(sid, p)
            for p in range(len(self.tokens[sid])):  # what attention reads: exactly its own KV
                assert self.pages[table[p // B]][p % B] == self._stamp(sid, p), (sid, p)
            targets[sid] = len(self.tokens[sid])
        for sid in self.tokens:
            if self.bm.is_swapped(sid):
                for p, h in zip(range(self.computed[sid]), [h for h in self.bm.host_block_table(sid)
                                                             for _ in range(B)], strict=False):
                    assert self.host[h][p % B] == self._stamp(sid, p)
        self.inflight.append((step, reads, targets))

    def sync(self, data):
        """A synchronous step: launch, then complete everything in flight."""
        self.launch(data)
        while self.inflight:
            self.complete(data)

    def complete(self, data):
        if not self.inflight:
            return
        step, _, targets = self.inflight.popleft()
        self.bm.step_completed(step)
        incoming = {d for _, d in self.pending["cow"]} | {p for _, p in self.pending["in"]}
        live = {s: t for s, t in targets.items() if s in self.tokens and not self.bm.is_swapped(s)}
        if data.draw(st.booleans(), label="batched"):
            self.bm.mark_computed_many(list(live), list(live.values()))
        for sid, t in live.items():
            assert self.computed[sid] <= t <= len(self.tokens[sid])
            self.bm.mark_computed(sid, t)  # idempotent after the batched call
            self.computed[sid] = t
            table = self.bm.block_table(sid)
            if incoming & set(table):
                continue  # a copy into its blocks is pending: checked at the next launch
            for p in range(t):
                assert self.pages[table[p // B]][p % B] == self._stamp(sid, p), (sid, p)
        self._after_op()

    def set_tokens(self, data):
        """Token ids arrive for some hidden slots; blocks they complete may get keyed now."""
        pending = [(s, p) for s in sorted(self.hidden) for p in sorted(self.hidden[s])]
        pairs = [sp for sp in pending if data.draw(st.booleans(), label=f"set {sp}")]
        if not pairs:
            return
        toks = [self.hidden[s][p] for s, p in pairs]
        if len(pairs) > 1 and data.draw(st.booleans(), label="repeat"):
            before = self.bm.stats()
            try:
                self.bm.set_tokens([s for s, _ in pairs] + [pairs[0][0]],
                                   [p for _, p in pairs] + [pairs[0][1]], toks + [toks[0]])
            except ValueError:
                assert self.bm.stats() == before
            else:
                raise AssertionError("a repeated pair must raise")
        self.bm.set_tokens([s for s, _ in pairs], [p for _, p in pairs], toks)
        for s, p in pairs:
            del self.hidden[s][p]
        self._after_op()

    def misuse(self, data):
        """Bad calls raise ValueError and change nothing."""
        before = (self.bm.stats(), {s: self.bm.num_tokens(s) for s in self.tokens},
                  self.bm.evictable_blocks())
        sid = self._seq_ids(data)
        calls = [lambda: self.bm.allocate(10**9, []), lambda: self.bm.append_slots(-1, [1]),
                 lambda: self.bm.step_completed(self.bm.last_begun_step + 1)]
        if sid is not None:
            calls += [lambda: self.bm.rollback(sid, len(self.tokens[sid]) + 1),
                      lambda: self.bm.allocate(sid, [1]),
                      lambda: self.bm.mark_computed(sid, len(self.tokens[sid]) + 1)]
        call = data.draw(st.sampled_from(calls))
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError("misuse did not raise")
        after = (self.bm.stats(), {s: self.bm.num_tokens(s) for s in self.tokens},
                 self.bm.evictable_blocks())
        assert before == after

    # --- invariants ---------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        for b in self.bm._index.blocks():  # every cached block holds exactly its key's KV
            key = self.bm.block_key(b)
            prefix = key.prefix_token_ids()
            for j in range(B):
                want = (key.salt, prefix[:len(prefix) - B + j + 1])
                assert self.pages[b][j] == want, f"cached block {b} slot {j}: {self.pages[b][j]}"
        for sid in self.tokens:
            assert self.bm.num_tokens(sid) == len(self.tokens[sid])
            assert self.bm.num_computed_tokens(sid) == self.computed[sid]
        st_ = self.bm.stats()
        assert (st_["num_free_blocks"] + st_["num_cached_blocks"] + st_["num_used_blocks"]
                + st_["num_quarantined_blocks"]) == self.NUM_BLOCKS - 1


class TwoStepQuarantineMachine(BlockManagerMachine):
    """Strong default hash, a two-step window, a tighter pool."""

    NUM_BLOCKS = 14
    NUM_HOST = 6
    QUARANTINE_STEPS = 2
    HASH_FN = None


class NoQuarantineMachine(BlockManagerMachine):
    """quarantine_steps=0: only the copy holds remain."""

    QUARANTINE_STEPS = 0


def _run(machine, examples, steps):
    # Shrinking a long failing run can take many minutes; set BLOCK_MANAGER_SHRINK=1 to shrink.
    phases = list(Phase) if os.environ.get("BLOCK_MANAGER_SHRINK") else [Phase.generate]
    machine.rules_run = 0
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, derandomize=True, deadline=None,
        suppress_health_check=list(HealthCheck), database=None, phases=phases))
    return machine.rules_run


def test_random_operations_weak_hash_one_step_window():
    assert _run(BlockManagerMachine, 40, 200) >= 4000


def test_random_operations_two_step_window():
    assert _run(TwoStepQuarantineMachine, 15, 150) >= 1500


def test_random_operations_without_window():
    assert _run(NoQuarantineMachine, 10, 150) >= 1000
