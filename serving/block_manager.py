"""Page ids of the paged KV pool: refcounts, a free list and the prefix cache.

The engine's pool holds `num_pages x page_size` token slots per layer (an MLA
latent and, in DSA layers, an indexer key per slot); page id p is slots
[p*page_size, (p+1)*page_size) in every layer. This module hands out page ids
and never touches tensors.

Prefix cache: a hash chain, as in vLLM's automatic prefix caching, rather than
SGLang's radix tree. A full page is identified by
sha256(parent page's key, its tokens), the root's parent being derived from
the request's cache_salt. Why the chain: the scheduler only ever reuses whole
pages (page_size tokens), which is exactly the granularity of a chain link, so
a tree's token-level matching would buy nothing; a flat dict gives O(1) lookup
per page, eviction is a plain LRU over refcount-0 pages with no tree to
rebalance or prune, and a request's keys depend only on its own tokens, so
they are computed once per request and reused every step.

Pages are in exactly one of three states:
  * free: refcount 0, no key (on the free list);
  * evictable: refcount 0 with a key (still findable; reclaimed LRU first);
  * used: refcount > 0 (in some request's block table; may have a key).
"""
from __future__ import annotations

import hashlib
import struct
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from serving.request import Request


def _root_key(cache_salt: str | None) -> bytes:
    # None and "" must differ, so the encoding tags which one it is.
    tag = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    return hashlib.sha256(b"glm5-prefix-root\x00" + tag).digest()


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of one full page given its parent's key.

    sha256 of a fixed-width encoding rather than Python's hash(): hash() is
    64 bits and easy to collide on purpose, and a collision here would serve
    another prompt's cache (wrong output, or a leak across tenants). A 256-bit
    digest makes an accidental or crafted collision practically impossible,
    keeps the key 32 bytes however deep the chain (a nested tuple key would
    be collision-free too, but hashing and comparing it costs the whole
    prefix every lookup).
    """
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


@dataclass
class _RequestKeys:
    """A request's chain keys, computed once: its tokens only ever grow."""
    keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0      # leading full pages already offered to the cache


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._refcount = [0] * num_pages
        self._page_key: list[bytes | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # first = least recently used
        self._key_to_page: dict[bytes, int] = {}
        # Weak keys: a dropped Request takes its keys with it, so nothing grows
        # with the number of requests ever served.
        self._req_keys: weakref.WeakKeyDictionary[Request, _RequestKeys] = weakref.WeakKeyDictionary()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------- stats
    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_pages

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_to_page)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._page_key[page] is not None

    def reset_prefix_cache(self) -> None:
        """Forget every cached page and the hit statistics.

        Pages in use keep their contents and owners; they are merely no longer
        findable, and go to the free list when released.
        """
        for page in self._evictable:
            self._free.append(page)
        self._evictable.clear()
        self._key_to_page.clear()
        self._page_key = [None] * self.num_pages
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------ the chain
    def _keys(self, req: Request, num_pages: int) -> list[bytes]:
        """The chain keys of req's first num_pages full pages (memoised)."""
        state = self._req_keys.get(req)
        if state is None:
            state = self._req_keys[req] = _RequestKeys()
        keys = state.keys
        if len(keys) < num_pages:
            ps, prompt, n = self.page_size, req.prompt_token_ids, req.num_prompt_tokens
            parent = keys[-1] if keys else _root_key(req.cache_salt)
            for i in range(len(keys), num_pages):
                lo, hi = i * ps, (i + 1) * ps
                # Slices, not req.all_token_ids: that property copies every token per call.
                tokens = (prompt[lo:hi] if hi <= n else
                          prompt[lo:] + req.output_token_ids[max(0, lo - n):hi - n])
                parent = page_key(parent, tokens)
                keys.append(parent)
        return keys

    def get_computed_prefix(self, req: Request) -> tuple[list[int], int]:
        """Cached pages matching the start of req's tokens, and their token count.

        At most (num_tokens - 1) // page_size pages: the last token is always
        computed, since its logits give the next token. Refcounts are left as
        they are; pass the pages to allocate_slots to take them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_pages = max(0, (req.num_tokens - 1) // self.page_size)
        pages: list[int] = []
        for i in range(max_pages):
            # One page's key at a time past what is memoised: a miss on page 0
            # of a long prompt costs one sha256, not the whole prompt's.
            key = self._keys(req, i + 1)[i]
            page = self._key_to_page.get(key)
            if page is None:
                break
            pages.append(page)
        return pages, len(pages) * self.page_size

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_pages: Sequence[int] = ()) -> bool:
        """Grow req.block_ids to cover num_computed_tokens + num_new_tokens tokens.

        computed_pages (from get_computed_prefix, for a request without pages;
        the caller has set req.num_computed_tokens to their token count) are
        taken first. Returns False and changes nothing if the pool is short.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed_pages = list(computed_pages)
        if computed_pages:
            if req.block_ids:
                raise ValueError("computed_pages: only a request without pages can take cached pages")
            if req.num_computed_tokens != len(computed_pages) * self.page_size:
                raise ValueError(
                    f"computed_pages: {len(computed_pages)} pages hold {len(computed_pages) * self.page_size} "
                    f"tokens but req.num_computed_tokens is {req.num_computed_tokens}")
            for page in computed_pages:
                if self._page_key[page] is None:
                    raise ValueError(f"computed_pages: page {page} is no longer cached (evicted since the lookup)")
        first_admission = not req.block_ids
        total = req.num_computed_tokens + num_new_tokens
        needed = -(-total // self.page_size) - len(req.block_ids) - len(computed_pages)
        # Cached pages about to be taken cannot also be evicted to make room.
        reclaimable = self.num_free_pages - sum(1 for p in computed_pages if self._refcount[p] == 0)
        if needed > reclaimable:
            return False
        for page in computed_pages:
            if self._refcount[page] == 0:
                del self._evictable[page]
            self._refcount[page] += 1
        req.block_ids.extend(computed_pages)
        for _ in range(max(0, needed)):
            req.block_ids.append(self._take_page())
        if first_admission and self.enable_prefix_caching and req.num_preemptions == 0:
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += len(computed_pages) * self.page_size
        return True

    def reserve_slots(self, req: Request, num_slots: int) -> bool:
        """Grow req.block_ids to cover slots 0 .. num_slots - 1 whatever is computed
        (padding a static batch computes there); False and nothing changed if the pool is short."""
        needed = -(-num_slots // self.page_size) - len(req.block_ids)
        if needed > self.num_free_pages:
            return False
        for _ in range(max(0, needed)):
            req.block_ids.append(self._take_page())
        return True

    def _take_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            key = self._page_key[page]
            self._page_key[page] = None
            del self._key_to_page[key]
        self._refcount[page] = 1
        return page

    def cache_full_pages(self, req: Request) -> None:
        """Make req's newly full, fully computed pages findable by later requests."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.page_size, len(req.block_ids))
        keys = self._keys(req, num_full)
        state = self._req_keys[req]
        for i in range(state.num_registered, num_full):
            page = req.block_ids[i]
            if self._page_key[page] is not None:
                continue                       # a prefix hit: already cached under this key
            key = keys[i]
            if key in self._key_to_page:
                # Another request computed the same prefix concurrently. Keep the
                # first (as vLLM does); this page stays private and goes to the
                # free list when released. Both hold identical tokens, so which
                # one later requests share does not matter.
                continue
            self._page_key[page] = key
            self._key_to_page[key] = page
        state.num_registered = max(state.num_registered, num_full)

    def free(self, req: Request) -> None:
        """Release req's pages; cached ones stay findable until evicted.

        Set a finishing request's status first: its memoised keys are dropped then.
        """
        # Reverse order: a chain's tail becomes least recently used before its
        # head, so eviction trims prefixes from the end, keeping shorter ones useful.
        for page in reversed(req.block_ids):
            self._refcount[page] -= 1
            if self._refcount[page] < 0:
                raise AssertionError(f"page {page} released more often than taken (request {req.request_id})")
            if self._refcount[page] == 0:
                if self._page_key[page] is not None:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        req.block_ids.clear()
        if req.status.finished:
            self._req_keys.pop(req, None)     # the caller may keep finished requests around
        elif req in self._req_keys:
            self._req_keys[req].num_registered = 0   # preempted: its keys stay valid, tokens only grow

    # ------------------------------------------------------------ checking
    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Raise AssertionError unless the page accounting is consistent.

        requests: every live request (those holding pages, waiting ones too).
        """
        expected = [0] * self.num_pages
        for req in requests:
            if len(set(req.block_ids)) != len(req.block_ids):
                raise AssertionError(f"request {req.request_id} holds a page twice: {req.block_ids}")
            for page in req.block_ids:
                expected[page] += 1
            needed = -(-req.num_computed_tokens // self.page_size)
            if len(req.block_ids) < needed:
                raise AssertionError(
                    f"request {req.request_id}: {req.num_computed_tokens} computed tokens need {needed} "
                    f"pages, it holds {len(req.block_ids)}")
            if len(req.block_ids) > -(-max(req.num_tokens, req.pad_end) // self.page_size):
                raise AssertionError(f"request {req.request_id} holds more pages than its {req.num_tokens} tokens "
                                     f"and padding to {req.pad_end} need")
            self._check_request_keys(req)
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        if free_set & self._evictable.keys():
            raise AssertionError(f"pages both free and evictable: {sorted(free_set & self._evictable.keys())}")
        num_used = 0
        for page in range(self.num_pages):
            rc, key = self._refcount[page], self._page_key[page]
            if rc != expected[page]:
                raise AssertionError(f"page {page}: refcount {rc} but {expected[page]} live requests hold it")
            if rc > 0:
                num_used += 1
                if page in free_set or page in self._evictable:
                    raise AssertionError(f"page {page} is referenced ({rc}) and also free/evictable")
            elif page in free_set and key is not None:
                raise AssertionError(f"free page {page} still has a cache key")
            elif page in self._evictable and key is None:
                raise AssertionError(f"evictable page {page} has no cache key")
            elif page not in free_set and page not in self._evictable:
                raise AssertionError(f"page {page} is lost: refcount 0, neither free nor evictable")
            if key is not None and self._key_to_page.get(key) != page:
                raise AssertionError(f"page {page} has a cache key under which the map points elsewhere")
        for key, page in self._key_to_page.items():
            if self._page_key[page] != key:
                raise AssertionError(f"the cache map points at page {page} under a key that is not its own")
        if len(free_set) + len(self._evictable) + num_used != self.num_pages:
            raise AssertionError(
                f"free {len(free_set)} + evictable {len(self._evictable)} + used {num_used} != {self.num_pages}")

    def _check_request_keys(self, req: Request) -> None:
        # A cached page in a block table must hold exactly the tokens the
        # request expects there (same chain key); else the cache serves wrong KV.
        num_full = min(req.num_computed_tokens // self.page_size, len(req.block_ids))
        if not self.enable_prefix_caching:
            return
        keys = self._keys(req, num_full)         # memoised: may hold more than num_full
        for i in range(num_full):
            key = self._page_key[req.block_ids[i]]
            if key is not None and key != keys[i]:
                raise AssertionError(f"request {req.request_id}: page {req.block_ids[i]} (logical {i}) "
                                     f"is cached under another prefix's key")
