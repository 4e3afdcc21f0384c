"""The serving engine's page manager and scheduler, driven by a fake engine (no model).

The fake engine keeps a fake KV pool: every slot it computes holds a digest of
(cache_salt, all tokens up to that position), and before computing a chunk it
checks that every earlier position of the request reads back its own digest.
So a page served from the prefix cache with the wrong content, across tenants,
or after being evicted and reused fails here, not only a miscounted refcount.
"""
import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from serving.block_manager import BlockManager
from serving.request import Request, RequestStatus
from serving.scheduler import Scheduler


def make_req(rid, tokens, max_tokens=8, salt=None):
    return Request(str(rid), list(tokens), SimpleNamespace(max_tokens=max_tokens), cache_salt=salt)


def make_sched(num_pages=32, page_size=4, caching=True, **kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 128)
    return Scheduler(BlockManager(num_pages, page_size, enable_prefix_caching=caching), **kw)


class FakeEngine:
    """schedule -> pretend-compute every chunk -> update -> sample, checking the KV it reads."""

    def __init__(self, sched, rng, vocab=3, stop_prob=0.0):
        self.sched, self.rng, self.vocab, self.stop_prob = sched, rng, vocab, stop_prob
        bm = sched.block_manager
        self.kv = [None] * (bm.num_pages * bm.page_size)
        self.finished = []
        self.num_steps = 0

    def _digests(self, req, end):
        h, out = hash(("salt", req.cache_salt)), []
        for tok in req.all_token_ids[:end]:
            h = hash((h, tok))
            out.append(h)
        return out

    def _slot(self, req, pos):
        ps = self.sched.block_manager.page_size
        return req.block_ids[pos // ps] * ps + pos % ps

    def step(self):
        self.num_steps += 1
        out = self.sched.schedule()
        for chunk in out.scheduled:
            req = chunk.request
            end = chunk.start + chunk.num_tokens
            # Padding (policy "static") writes garbage on the request's own pages: a real token that
            # reads it, or a shared page it lands on, fails the digest check below.
            for pos in range(end, end + chunk.num_pad):
                self.kv[self._slot(req, pos)] = "pad"
            if chunk.num_tokens == 0:
                assert req.status.finished, "only a finished member of a static batch computes padding alone"
                continue
            assert chunk.start == req.num_computed_tokens
            digests = self._digests(req, end)
            for pos in range(chunk.start):
                assert self.kv[self._slot(req, pos)] == digests[pos], \
                    f"{req.request_id}: position {pos} reads another prefix's KV"
            for pos in range(chunk.start, end):
                self.kv[self._slot(req, pos)] = digests[pos]
            self.sched.update_from_step(chunk)
        for chunk in out.scheduled:      # as the engine: the whole step's forward, then sampling
            req = chunk.request
            if chunk.reaches_end:
                req.output_token_ids.append(self.rng.randrange(self.vocab))
                if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.sched.max_model_len:
                    self._finish(req, RequestStatus.FINISHED_LENGTH)
                elif self.rng.random() < self.stop_prob:
                    self._finish(req, RequestStatus.FINISHED_STOPPED)
        return out

    def _finish(self, req, status):
        self.sched.finish_request(req, status)
        self.finished.append(req)

    def run_to_end(self, max_steps=10_000):
        outs = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return outs
            outs.append(self.step())
            self.sched.check_invariants()
        raise AssertionError("requests did not drain")


def assert_pool_whole(bm):
    assert bm.num_free_pages == bm.num_pages and bm.num_used_pages == 0 and bm.usage == 0.0
    assert all(bm.refcount(p) == 0 for p in range(bm.num_pages))
    bm.check_invariants([])


# --------------------------------------------------------------- page manager
def test_prefix_hit_reuses_pages_with_refcount_k():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10))                    # two full pages and two tokens
    first = make_req(0, prompt)
    assert bm.get_computed_prefix(first) == ([], 0)
    assert bm.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    bm.cache_full_pages(first)
    sharers = [first]
    for k in range(2, 5):
        req = make_req(k, prompt)
        pages, n = bm.get_computed_prefix(req)
        assert pages == first.block_ids[:2] and n == 8
        assert [bm.refcount(p) for p in pages] == [k - 1] * 2     # lookup does not take
        req.num_computed_tokens = n
        assert bm.allocate_slots(req, 2, pages)
        assert req.block_ids[:2] == pages and req.block_ids[2] not in first.block_ids
        assert [bm.refcount(p) for p in pages] == [k] * 2
        sharers.append(req)
        bm.check_invariants(sharers)
    assert bm.prefix_cache_queries == 40 and bm.prefix_cache_hits == 24
    assert bm.hit_rate == pytest.approx(0.6)
    for req in sharers:
        bm.free(req)
    assert bm.num_free_pages == 16 and bm.num_cached_pages == 2
    bm.check_invariants([])


def test_different_cache_salt_gets_no_hit():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    owner = make_req(0, range(9), salt="tenant-a")
    bm.allocate_slots(owner, 9)
    owner.num_computed_tokens = 9
    bm.cache_full_pages(owner)
    assert bm.get_computed_prefix(make_req(1, range(9), salt="tenant-a"))[1] == 8
    for salt in ("tenant-b", None, ""):
        assert bm.get_computed_prefix(make_req(2, range(9), salt=salt)) == ([], 0)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    owner = make_req(0, range(9))
    bm.allocate_slots(owner, 9)
    owner.num_computed_tokens = 9
    bm.cache_full_pages(owner)
    bm.free(owner)
    assert bm.get_computed_prefix(make_req(1, range(9))) == ([], 0)
    assert bm.num_cached_pages == 0 and bm.prefix_cache_queries == 0


def test_last_token_never_served_from_cache():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    owner = make_req(0, range(8))               # exactly two pages
    bm.allocate_slots(owner, 8)
    owner.num_computed_tokens = 8
    bm.cache_full_pages(owner)
    assert bm.num_cached_pages == 2
    pages, n = bm.get_computed_prefix(make_req(1, range(8)))
    assert n == 4 and pages == owner.block_ids[:1]           # the 8th token is recomputed
    assert bm.get_computed_prefix(make_req(2, range(9)))[1] == 8
    assert bm.get_computed_prefix(make_req(3, range(1))) == ([], 0)


def _cache_and_free(bm, req):
    assert bm.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_pages(req)
    bm.free(req)


def test_lru_eviction_order_tail_first_then_least_recent():
    bm = BlockManager(5, 2, enable_prefix_caching=True)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    _cache_and_free(bm, make_req("a", a))
    _cache_and_free(bm, make_req("b", b))
    hit = lambda toks: bm.get_computed_prefix(make_req("q", toks + [0]))[1]   # noqa: E731
    assert bm.num_free_pages == 5 and hit(a) == 4 and hit(b) == 4
    # Reuse a (taken and released again): now b is the least recently used.
    # Its third page comes from the free list, which goes before any eviction.
    again = make_req("a2", a + [9])
    pages, n = bm.get_computed_prefix(again)
    again.num_computed_tokens = n
    assert bm.allocate_slots(again, 1, pages)
    bm.free(again)
    order = []
    for i in range(5):                           # one page at a time, never released
        assert bm.allocate_slots(make_req(f"x{i}", [0]), 1)
        order.append((hit(a), hit(b)))
    # The free page first; then b's tail, b's head, a's tail, a's head.
    assert order == [(4, 4), (4, 2), (4, 0), (2, 0), (0, 0)]
    assert not bm.allocate_slots(make_req("y", [0]), 1)


def test_allocate_failure_changes_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    holder = make_req(0, range(8))
    assert bm.allocate_slots(holder, 8)
    req = make_req(1, range(20))
    assert not bm.allocate_slots(req, 20)       # needs 5 pages, 2 left
    assert req.block_ids == [] and bm.num_free_pages == 2 and bm.prefix_cache_queries == 8
    bm.check_invariants([holder, req])


def test_concurrent_identical_prefix_keeps_one_cached_copy():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    r1, r2 = make_req(1, range(9)), make_req(2, range(9))
    for r in (r1, r2):
        assert bm.get_computed_prefix(r) == ([], 0)     # neither computed yet
        assert bm.allocate_slots(r, 9)
    for r in (r1, r2):
        r.num_computed_tokens = 9
        bm.cache_full_pages(r)
    bm.check_invariants([r1, r2])
    assert bm.num_cached_pages == 2
    assert bm.get_computed_prefix(make_req(3, range(9)))[0] == r1.block_ids[:2]
    bm.free(r1)
    bm.free(r2)
    assert bm.num_free_pages == 8 and bm.num_cached_pages == 2
    bm.check_invariants([])


def test_reset_prefix_cache():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    _cache_and_free(bm, make_req(0, range(9)))
    assert bm.num_cached_pages == 2 and bm.prefix_cache_queries == 9
    bm.reset_prefix_cache()
    assert bm.num_cached_pages == 0 and bm.prefix_cache_queries == 0 and bm.num_free_pages == 8
    assert bm.get_computed_prefix(make_req(1, range(9))) == ([], 0)
    bm.check_invariants([])


def test_check_invariants_catches_corruption():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    req = make_req(0, range(6))
    bm.allocate_slots(req, 6)
    with pytest.raises(AssertionError, match="refcount"):
        bm.check_invariants([])                  # a holder the caller forgot
    req.block_ids.append(req.block_ids[0])
    with pytest.raises(AssertionError, match="twice"):
        bm.check_invariants([req])


# ------------------------------------------------------------------ scheduler
def test_preemption_pushes_to_front_and_recomputes():
    sched = make_sched(num_pages=4, page_size=4, caching=False)
    engine = FakeEngine(sched, random.Random(0))
    r1, r2, r3 = make_req(1, range(8), 8), make_req(2, range(7), 8), make_req(3, range(3), 2)
    for r in (r1, r2):
        sched.add_request(r)
    out = engine.step()                          # both prefilled: 4 pages, pool full
    assert [c.request for c in out.scheduled] == [r1, r2] and sched.block_manager.num_free_pages == 0
    sched.add_request(r3)
    out = engine.step()                          # r1's 9th token needs a 3rd page
    assert out.preempted == [r2]
    assert [c.request for c in out.scheduled] == [r1]   # r3 would fit, but r2 is ahead of it (FCFS)
    assert list(sched.waiting) == [r2, r3] and r2.status == RequestStatus.WAITING
    assert r2.num_computed_tokens == 0 and r2.block_ids == [] and r2.num_preemptions == 1
    assert len(r2.output_token_ids) == 1        # what it generated is kept
    sched.check_invariants()
    while r2.status == RequestStatus.WAITING:
        out = engine.step()
        sched.check_invariants()
    chunk = next(c for c in out.scheduled if c.request is r2)
    assert chunk.start == 0 and chunk.num_tokens == 8    # recomputed: prompt + its first output
    assert len(r2.output_token_ids) == 2
    engine.run_to_end()
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in (r1, r2, r3))
    assert_pool_whole(sched.block_manager)


def test_budget_and_max_num_seqs_respected_every_step():
    sched = make_sched(num_pages=64, max_num_seqs=3, max_num_batched_tokens=16)
    engine = FakeEngine(sched, random.Random(1))
    for i in range(10):
        sched.add_request(make_req(i, [i] * 20, max_tokens=5))
    for out in engine.run_to_end():
        assert out.num_batched_tokens <= 16 and len(out.scheduled) <= 3
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.scheduled)
    assert len(engine.finished) == 10


def test_decodes_scheduled_before_new_prefills():
    sched = make_sched(max_num_batched_tokens=4)
    engine = FakeEngine(sched, random.Random(2))
    r1 = make_req(1, range(4), max_tokens=10)
    sched.add_request(r1)
    engine.step()
    sched.add_request(make_req(2, range(10, 20)))
    out = engine.step()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.scheduled] == [("1", 4, 1), ("2", 0, 3)]


def test_fcfs_head_blocks_later_waiting_requests():
    sched = make_sched(num_pages=6, page_size=4)
    sched.add_request(make_req(1, range(16), max_tokens=4))     # 4 pages
    sched.add_request(make_req(2, range(12), max_tokens=4))     # needs 3: does not fit
    sched.add_request(make_req(3, range(2), max_tokens=2))      # would fit, must not overtake
    out = sched.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["1"] and sched.num_waiting == 2


def test_chunked_prefill_by_threshold_and_by_budget():
    sched = make_sched(long_prefill_token_threshold=8, max_num_batched_tokens=100)
    engine = FakeEngine(sched, random.Random(3))
    sched.add_request(make_req(1, range(25), max_tokens=2))
    chunks = [(c.start, c.num_tokens) for out in engine.run_to_end() for c in out.scheduled]
    assert chunks == [(0, 8), (8, 8), (16, 8), (24, 1), (25, 1)]
    sched = make_sched(max_num_batched_tokens=10)
    engine = FakeEngine(sched, random.Random(3))
    sched.add_request(make_req(1, range(25), max_tokens=1))
    chunks = [(c.start, c.num_tokens) for out in engine.run_to_end() for c in out.scheduled]
    assert chunks == [(0, 10), (10, 10), (20, 5)]


def test_prefix_hit_at_admission_sets_cached_tokens():
    sched = make_sched(page_size=4)
    engine = FakeEngine(sched, random.Random(4))
    shared = list(range(12))
    sched.add_request(make_req(1, shared + [1], max_tokens=1))
    engine.run_to_end()
    r2 = make_req(2, shared + [2, 2], max_tokens=1)
    sched.add_request(r2)
    out = engine.step()
    assert (out.scheduled[0].start, out.scheduled[0].num_tokens) == (12, 2)
    assert r2.num_cached_tokens == 12 and sched.block_manager.prefix_cache_hits == 12


def test_static_policy_admits_only_when_batch_finished():
    def run(policy, budget):
        sched = make_sched(num_pages=64, max_num_seqs=2, max_num_batched_tokens=budget, policy=policy)
        engine = FakeEngine(sched, random.Random(5))
        for rid, max_tokens in ((1, 2), (2, 6), (3, 2)):
            sched.add_request(make_req(rid, range(10), max_tokens=max_tokens))
        return sched, engine.run_to_end()

    sched, outs = run("static_unpadded", 4)
    # Prompts prefilled whole despite the budget of 4; request 3 waits for the whole batch.
    assert [(c.request.request_id, c.num_tokens) for c in outs[0].scheduled] == [("1", 10), ("2", 10)]
    ids = [[c.request.request_id for c in out.scheduled] for out in outs]
    assert ids == [["1", "2"], ["1", "2"]] + [["2"]] * 4 + [["3"], ["3"]]
    assert sched.slot_utilisation == pytest.approx(10 / 16)
    assert sched.padding_fraction == 0
    continuous, outs = run("continuous", 64)     # request 3 takes request 1's slot at once
    assert [[c.request.request_id for c in out.scheduled] for out in outs][2] == ["2", "3"]
    assert continuous.slot_utilisation == pytest.approx(10 / 12)


def test_static_policy_pads_prompts_and_finished_slots_until_the_batch_ends():
    sched = make_sched(num_pages=64, max_num_seqs=2, max_num_batched_tokens=4, policy="static")
    bm = sched.block_manager
    engine = FakeEngine(sched, random.Random(5))
    short, long_, late = make_req(1, range(5), max_tokens=2), make_req(2, range(12), max_tokens=5), \
        make_req(3, range(3), max_tokens=2)
    for r in (short, long_, late):
        sched.add_request(r)
    out = engine.step()
    # Right-padded to the batch's longest prompt: 5 real + 7 pad tokens, on the request's own pages.
    assert [(c.request.request_id, c.num_tokens, c.num_pad) for c in out.scheduled] == [("1", 5, 7), ("2", 12, 0)]
    assert short.pad_end == 12 and len(short.block_ids) == 3 and out.num_batched_tokens == 24
    pages_of_short = list(short.block_ids)
    steps = [engine.step() for _ in range(3)]       # short finishes after its 2nd token, long after its 5th
    assert short.status.finished and short.block_ids[:3] == pages_of_short     # a ghost keeps its pages
    ghost_chunks = [c for out in steps for c in out.scheduled if c.request is short and c.num_tokens == 0]
    assert [(c.start, c.num_pad) for c in ghost_chunks] == [(12, 1), (13, 1)]
    sched.check_invariants()
    assert not late.block_ids and late.status == RequestStatus.WAITING
    while long_.status == RequestStatus.RUNNING:
        engine.step()
    assert short.block_ids == [] and long_.block_ids == []      # the batch ended: every page back
    engine.run_to_end()
    assert_pool_whole(bm)
    # Real tokens 5 + 12 + 4 decodes of long + 1 of short + 3 + 1; pad 7 + 3 ghost steps.
    assert sched.num_pad_tokens == 10 and sched.padding_fraction == pytest.approx(10 / (10 + sched.num_real_tokens))


def test_static_batch_that_fits_only_unpadded_sends_its_last_member_back():
    sched = make_sched(num_pages=5, page_size=4, max_num_seqs=2, max_model_len=20, policy="static")
    engine = FakeEngine(sched, random.Random(7))
    a, b = make_req(1, range(2), max_tokens=1), make_req(2, range(16), max_tokens=1)
    for r in (b, a):
        sched.add_request(r)
    out = engine.step()
    # b holds 4 pages; a padded to 16 would need 4 more of the 1 left: a waits for the next batch.
    assert [c.request.request_id for c in out.scheduled] == ["2"] and out.preempted == [a]
    engine.run_to_end()
    assert a.status.finished and b.status.finished
    assert_pool_whole(sched.block_manager)


def test_abort_waiting_mid_prefill_and_mid_decode_frees_pages():
    sched = make_sched(num_pages=16, page_size=4, long_prefill_token_threshold=8, max_num_seqs=2,
                       max_num_batched_tokens=12)
    bm = sched.block_manager
    engine = FakeEngine(sched, random.Random(6))
    decoding, prefilling, waiting = (make_req(i, range(i, i + 20), max_tokens=20) for i in range(3))
    for r in (decoding, prefilling, waiting):
        sched.add_request(r)
    while decoding.num_computed_tokens < 20:
        engine.step()
    assert 0 < prefilling.num_computed_tokens < 20 and decoding.output_token_ids
    assert sched.abort_request("2") is waiting and waiting.status == RequestStatus.FINISHED_ABORTED
    for req in (prefilling, decoding):
        held, free_before = len(req.block_ids), bm.num_free_pages
        assert held > 0
        assert sched.abort_request(req.request_id) is req
        assert bm.num_free_pages == free_before + held and req.block_ids == []
        assert req.status == RequestStatus.FINISHED_ABORTED
        sched.check_invariants()
    assert sched.abort_request("1") is None and not sched.has_unfinished_requests()
    assert_pool_whole(bm)


def test_abort_while_step_in_flight_is_ignored_by_update():
    sched = make_sched()
    req = make_req(1, range(6))
    sched.add_request(req)
    out = sched.schedule()
    sched.abort_request("1")
    sched.update_from_step(out.scheduled[0])
    assert req.num_computed_tokens == 0
    assert_pool_whole(sched.block_manager)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_pages=0, page_size=4), "num_pages"),
    (dict(num_pages=4, page_size=0), "page_size"),
])
def test_block_manager_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BlockManager(**kwargs, enable_prefix_caching=True)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(policy="greedy"), "policy"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
])
def test_scheduler_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_sched(**kwargs)


@pytest.mark.parametrize("tokens, max_tokens", [
    (200, 1),     # longer than max_model_len 128
    (100, 1),     # 25 pages of 4, the pool has 16
    (40, 60),     # the prompt fits, prompt + max_tokens never could
    (0, 1),       # empty
])
def test_add_request_that_can_never_run(tokens, max_tokens):
    sched = make_sched(num_pages=16, page_size=4, max_model_len=128)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_req(1, range(tokens), max_tokens=max_tokens))
    assert not sched.has_unfinished_requests()


def test_add_request_twice_and_finish_unknown():
    sched = make_sched()
    req = make_req(1, range(4))
    sched.add_request(req)
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_req(1, range(4)))
    with pytest.raises(ValueError, match="status"):
        sched.finish_request(req, RequestStatus.RUNNING)
    sched.finish_request(req, RequestStatus.FINISHED_STOPPED)
    with pytest.raises(ValueError, match="req"):
        sched.finish_request(req, RequestStatus.FINISHED_STOPPED)


# ------------------------------------------------------- randomized accounting
@pytest.mark.parametrize("policy, caching", [("continuous", True), ("continuous", False), ("static", True),
                                             ("static_unpadded", True)])
def test_randomized_page_accounting(policy, caching):
    rng = random.Random(1234)
    page_size, budget, max_seqs = 4, 24, 6
    sched = make_sched(num_pages=20, page_size=page_size, caching=caching, max_num_seqs=max_seqs,
                       max_num_batched_tokens=budget, max_model_len=48,
                       long_prefill_token_threshold=10 if policy == "continuous" else 0, policy=policy)
    bm = sched.block_manager
    engine = FakeEngine(sched, rng, vocab=3, stop_prob=0.05)
    prefixes = [[rng.randrange(3) for _ in range(n)] for n in (8, 13, 20)]
    added, aborted = [], {"waiting": 0, "prefill": 0, "decode": 0}
    start = time.perf_counter()
    for step in range(2500):
        adding = step < 2000
        if adding and rng.random() < 0.35:
            tail = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            req = make_req(f"r{len(added)}", rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 16),
                           salt=rng.choice([None, "a", "b"]))
            sched.add_request(req)
            added.append(req)
        if adding and rng.random() < 0.04 and sched.has_unfinished_requests():
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            kind = ("waiting" if victim.status == RequestStatus.WAITING else
                    "prefill" if victim.num_computed_tokens < victim.num_prompt_tokens else "decode")
            releasing = [victim]
            if victim.status == RequestStatus.RUNNING and sched.num_running == 1:   # the static batch ends
                releasing += sched.padding_requests
            held = Counter(p for r in releasing for p in r.block_ids)
            private = sum(bm.refcount(p) == k for p, k in held.items())
            free_before = bm.num_free_pages
            assert sched.abort_request(victim.request_id) is victim
            assert victim.block_ids == [] and bm.num_free_pages == free_before + private
            assert kind != "waiting" or private == 0
            aborted[kind] += 1
        out = engine.step()
        if policy == "continuous":
            assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_seqs and sched.num_running <= max_seqs
        sched.check_invariants()
        if not sched.has_unfinished_requests() and not adding:
            break
    engine.run_to_end()
    assert engine.num_steps >= 2000
    assert_pool_whole(bm)
    assert all(r.status.finished for r in added)
    for r in added:
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert len(r.output_token_ids) == r.params.max_tokens or r.num_tokens >= 48
    assert sum(r.num_preemptions for r in added) > 0, "the small pool must force preemptions"
    # A static batch prefills whole within a step: no abort can land mid-prefill.
    assert all(n > 0 for kind, n in aborted.items() if policy == "continuous" or kind != "prefill"), aborted
    if caching:
        assert bm.prefix_cache_hits > 0 and any(r.num_cached_tokens for r in added)
    else:
        assert bm.prefix_cache_hits == 0
    assert 0 < sched.slot_utilisation <= 1
    assert time.perf_counter() - start < 20
