"""Stateful random testing of KVCacheManager against a shadow model.

The machine keeps the tokens of every sequence and a simulated device KV pool (GPU and
CPU tiers, one token id per slot). It plays the engine: after each call it runs the
block copies the manager handed out, in order, then "writes KV" for new tokens through
the block table (only ever into private blocks). Some prompts are added as chunked prefills
(`computed=0`): their KV is written a chunk at a time, each chunk declared with mark_computed.
Reading every sequence back through its table must give its tokens, up to what has been
written, which checks copy-on-write, prefix-cache reuse (a hit must hold written KV),
eviction and swapping end to end.

Each operation is one manager call. Hypothesis picks operations one by one (good
shrinking), and a `burst` rule runs many operations from a seeded numpy generator
(cheap draws), so the suite covers >= 10^5 operations in well under a minute. Every
invariant is checked after every operation.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fingerprint
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kgen.paging import (
    DuplicateSequence,
    KVCacheManager,
    NotResident,
    PagingError,
    PoolExhausted,
    SwapSpaceExhausted,
    UnknownSequence,
    preempt,
)

MAX_EXAMPLES, STEPS = 180, 50  # 1.3-1.5e5 operations, 15-35 s
MIN_OPS = 100_000
COUNT = {"ops": 0, "checks": 0}  # manager operations and checks run by the current test
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7]]


class HypSource:
    """Random choices drawn by Hypothesis."""

    def __init__(self, data):
        self.data = data

    def pick(self, xs):
        return self.data.draw(st.sampled_from(xs))

    def int(self, lo, hi):
        return self.data.draw(st.integers(lo, hi))

    def tokens(self, n):
        return self.data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))


class RngSource:
    """Random choices from a seeded numpy generator (the seed is drawn by Hypothesis)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def pick(self, xs):
        return xs[int(self.rng.integers(len(xs)))]

    def int(self, lo, hi):
        return int(self.rng.integers(lo, hi + 1))

    def tokens(self, n):
        return self.rng.integers(0, 4, n).tolist()


class PagingMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 24),
        num_cpu=st.integers(0, 12),
        caching=st.booleans(),
    )
    def setup(self, block_size, num_blocks, num_cpu, caching):
        self.m = KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu, enable_prefix_caching=caching)
        self.B = block_size
        self.shadow: dict[int, list[int]] = {}
        self.written: dict[int, int] = {}  # leading tokens of each sequence whose KV is written
        self.dev = {
            False: np.full((num_blocks, block_size), -1),
            True: np.full((max(num_cpu, 1), block_size), -1),
        }
        self.next_id = 0

    # ---- the engine's side ----------------------------------------------------------

    def resident(self) -> list[int]:
        return sorted(s for s in self.shadow if self.m.is_resident(s))

    def swapped(self) -> list[int]:
        return sorted(s for s in self.shadow if not self.m.is_resident(s))

    def run_copies(self, copies, src_cpu: bool, dst_cpu: bool) -> None:
        for src, dst in copies:
            self.dev[dst_cpu][dst] = self.dev[src_cpu][src]

    def write(self, sid: int, start: int, end: int | None = None) -> None:
        """The kernel: pending copies first, then KV of tokens start..end of sid."""
        self.run_copies(self.m.pending_copies(), False, False)
        table, toks = self.m.block_table(sid), self.shadow[sid]
        end = len(toks) if end is None else end
        for p in range(start, end):
            blk = table[p // self.B]
            assert self.m._gpu.refcount[blk] == 1, "a write into a shared block"
            self.dev[False][blk, p % self.B] = toks[p]
        self.written[sid] = end

    def complete(self) -> list[int]:
        """Resident sequences whose prompt is all written: the ones an engine decodes or forks."""
        return [s for s in self.resident() if self.written[s] == len(self.shadow[s])]

    def attempt(self, call, exc) -> tuple[bool, object]:
        """Run call; if it raises exc the manager must be exactly as before."""
        before = fingerprint(self.m)
        try:
            return True, call()
        except exc:
            assert fingerprint(self.m) == before, "a refused call changed the manager"
            return False, None

    def check(self) -> None:
        COUNT["checks"] += 1
        self.m.check_invariants(deep=COUNT["checks"] % 4 == 0)  # hash recomputation is the slow part
        for sid, toks in self.shadow.items():
            s = self.m._seqs[sid]
            assert self.m._store.tokens[s.slot, : self.m._store.lens[s.slot]].tolist() == toks
            table = self.m._store.blocks(s.slot, self.B)
            n = self.written[sid]
            got = self.dev[s.on_cpu][table].reshape(-1)[:n]
            assert got.tolist() == toks[:n], f"sequence {sid} reads back wrong KV"

    # ---- operations (one manager call each) ------------------------------------------------

    def op_add(self, src) -> None:
        sid = self.next_id
        self.next_id += 1
        prompt = src.pick(PREFIXES) + src.tokens(src.int(0, 9))
        salt = src.pick([None, "s"])
        chunked = src.pick([False, True])
        ok, cached = self.attempt(
            lambda: self.m.add_sequence(sid, prompt, salt=salt, computed=0 if chunked else None), PoolExhausted
        )
        if ok:
            assert cached % self.B == 0 and (cached < len(prompt) or not prompt)
            self.shadow[sid] = list(prompt)
            # prefill computes only what the cache lacks; a chunked one nothing yet (op_chunk)
            self.write(sid, cached, cached if chunked else None)

    def op_chunk(self, src) -> None:
        """One chunk of a chunked prefill: write its KV, then declare it computed."""
        todo = [s for s in self.resident() if self.written[s] < len(self.shadow[s])]
        if todo:
            sid = src.pick(todo)
            start = self.written[sid]
            end = start + src.int(1, len(self.shadow[sid]) - start)
            self.write(sid, start, end)
            self.m.mark_computed(sid, end)

    def op_append(self, src, batch=None) -> None:
        live = self.complete()
        if batch is None:
            if not live:
                return
            batch = sorted({src.pick(live) for _ in range(src.int(1, len(live)))})
        toks = src.tokens(len(batch))
        ids = np.asarray(batch, dtype=np.int64)
        arr = np.asarray(toks, dtype=np.int32)
        if not self.attempt(lambda: self.m.append_tokens(ids, arr), PoolExhausted)[0]:
            return
        for s, t in zip(batch, toks, strict=True):
            self.shadow[s].append(t)
            self.write(s, len(self.shadow[s]) - 1)
        assert self.m.seq_lens(ids).tolist() == [len(self.shadow[s]) for s in batch]
        for row, s in zip(self.m.block_tables(ids), batch, strict=True):
            assert row[: len(self.m.block_table(s))].tolist() == self.m.block_table(s)

    def op_decode(self, src) -> None:
        """Several steps of one batch: exercises the in-place batch table."""
        live = self.complete()
        for _ in range(src.int(1, 9)):
            if live:
                COUNT["ops"] += 1  # each step is one append_tokens call
                self.op_append(src, batch=live)
                self.check()

    def op_fork(self, src) -> None:
        live = self.complete()
        if live:
            parent, child = src.pick(live), self.next_id
            self.next_id += 1
            self.m.fork(parent, child)
            self.shadow[child] = list(self.shadow[parent])
            self.written[child] = self.written[parent]

    def op_free(self, src) -> None:
        if self.shadow:
            sid = src.pick(sorted(self.shadow))
            self.m.free(sid)
            del self.shadow[sid], self.written[sid]

    def op_swap_out(self, src) -> None:
        live = self.resident()
        if live:
            sid = src.pick(live)
            ok, copies = self.attempt(lambda: self.m.swap_out(sid), SwapSpaceExhausted)
            if ok:
                self.run_copies(copies, False, True)

    def op_swap_in(self, src) -> None:
        out = self.swapped()
        if out:
            sid = src.pick(out)
            ok, copies = self.attempt(lambda: self.m.swap_in(sid), PoolExhausted)
            if ok:
                self.run_copies(copies, True, False)

    def op_preempt(self, src) -> None:
        r = preempt(self.m, src.int(0, 8), mode=src.pick(["swap", "recompute"]))
        self.run_copies(r.copies, False, True)
        for s in r.freed:
            del self.shadow[s], self.written[s]

    def op_bad_input(self, src) -> None:
        m = self.m
        calls = [(lambda: m.free(10**6), UnknownSequence), (lambda: m.block_tables([10**6]), UnknownSequence)]
        if self.shadow:
            s = src.pick(sorted(self.shadow))
            calls += [
                (lambda: m.fork(s, s), PagingError),
                (lambda: m.add_sequence(s, [1]), DuplicateSequence),
            ]
            if not m.is_resident(s):
                calls.append((lambda: m.block_tables([s]), NotResident))
        call, exc = src.pick(calls)
        before = fingerprint(m)
        try:
            call()
        except exc:
            assert fingerprint(m) == before
        else:
            raise AssertionError("bad input was accepted")

    def op_free_all(self, src=None) -> None:
        for s in list(self.shadow):
            self.m.free(s)
        self.shadow.clear()
        self.written.clear()
        s = self.m.stats()
        assert s["free_blocks"] + s["cached_blocks"] == self.m.num_blocks and s["used_blocks"] == 0
        assert s["cpu_free_blocks"] == self.m.num_cpu_blocks

    def do(self, op: str, src) -> None:
        COUNT["ops"] += op != "decode"  # decode counts its steps
        getattr(self, f"op_{op}")(src)

    OPS = ("add", "add", "chunk", "chunk", "append", "decode", "fork", "free", "swap_out", "swap_in", "preempt",
           "bad_input")

    # ---- rules --------------------------------------------------------------------------------

    @rule(op=st.sampled_from(OPS), data=st.data())
    def one(self, op, data):
        self.do(op, HypSource(data))

    @rule(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60))
    def burst(self, seed, n):
        src = RngSource(seed)
        for _ in range(n):
            self.do(src.pick(self.OPS), src)
            self.check()

    @precondition(lambda self: len(self.shadow) > 6)
    @rule()
    def free_all(self):
        COUNT["ops"] += 1
        self.op_free_all()

    @invariant()
    def consistent(self):
        self.check()

    def teardown(self):
        if hasattr(self, "m"):
            self.op_free_all()
            self.m.check_invariants()


SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.full  # ~30 s of hypothesis; the manager's rules are tested by default in test_manager.py and test_invariants.py
def test_paging_state_machine():
    """The random walks pass every check, and they are long enough to mean something:
    at least MIN_OPS manager operations in this run."""
    COUNT.update(ops=0, checks=0)
    run_state_machine_as_test(PagingMachine, settings=SETTINGS)
    assert COUNT["ops"] >= MIN_OPS, f"only {COUNT['ops']} operations ran (the suite promises {MIN_OPS})"
