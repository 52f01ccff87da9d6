"""The KV page pool: which pages of the paged caches (dsl/paging.py) each sequence holds, and a
cache of full pages by the tokens they hold, so that a prompt prefix seen before is not
prefilled again.

    pool = PagePool(pages=1024, page=16)
    shared = pool.match(ids)          # pages holding the longest known prefix of ids (acquired)
    fresh = pool.allocate(3)          # None when the pool cannot give 3 pages now
    pool.publish(page_table, ids)     # the full pages of a sequence become findable by match
    pool.release(page_table)          # the sequence ended: its pages back, published ones kept

A page is free, held (by one or more sequences: a shared prefix), or cached: published, held by
none, and kept until a page is needed (least recently released first). A full page is known by
its tokens and the page before it, so two prompts share a page only when they agree on every
token up to its end. Pages are never written once published: a sequence writes only the pages
past its shared prefix.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from ..errors import FuselmError

_NO_PARENT = -1


class PagePool:
    """`pages` pages of `page` rows each (see the module docstring)."""

    def __init__(self, pages: int, page: int):
        if pages < 1 or page < 1:
            raise FuselmError(f"a KV page pool needs at least one page of at least one row, got {pages} x {page}")
        self.pages, self.page = pages, page
        self._free: deque[int] = deque(range(pages))
        self._refs = [0] * pages
        self._cached: OrderedDict[int, None] = OrderedDict()   # published pages no sequence holds, LRU first
        self._key_of: dict[int, tuple] = {}                     # published page -> (parent id, tokens)
        self._page_of: dict[tuple, int] = {}                    # its inverse
        self._id_of: dict[int, int] = {}                        # published page -> its id as a parent
        self._next_id = 0

    # ---- counts ----
    @property
    def held(self) -> int:
        """Pages some sequence holds."""
        return self.pages - len(self._free) - len(self._cached)

    @property
    def available(self) -> int:
        """Pages allocate() can give now: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._cached)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` rows."""
        return -(-tokens // self.page)

    # ---- sequences ----
    def match(self, ids: Sequence[int], limit: int | None = None) -> list[int]:
        """The published pages holding the longest prefix of `ids` in whole pages, at most
        `limit` tokens of it; each is acquired (held once more)."""
        limit = len(ids) if limit is None else min(limit, len(ids))
        found, parent = [], _NO_PARENT
        for start in range(0, limit - self.page + 1, self.page):
            page = self._page_of.get((parent, tuple(ids[start:start + self.page])))
            if page is None:
                break
            found.append(page)
            parent = self._id_of[page]
        for page in found:
            self._acquire(page)
        return found

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages for one sequence to write, or None (taking nothing) when fewer are available.
        Free pages go first, then the least recently released cached ones, forgotten."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                self._forget(page)
            self._refs[page] = 1
            out.append(page)
        return out

    def publish(self, table: Sequence[int], ids: Sequence[int]) -> None:
        """Make the full pages of a sequence findable: `table` its pages in order, `ids` the tokens
        whose rows are written (a page publishes once all its rows are). Pages already published
        (a shared prefix) stay as they are; a page whose tokens another page already holds stays
        private (it is freed on release)."""
        parent = _NO_PARENT
        for j in range(len(ids) // self.page):
            page = table[j]
            if page not in self._key_of:
                key = (parent, tuple(ids[j * self.page:(j + 1) * self.page]))
                if key in self._page_of:
                    return           # an equal page exists: its descendants are keyed under it, not this one
                self._key_of[page], self._page_of[key] = key, page
                self._id_of[page], self._next_id = self._next_id, self._next_id + 1
            parent = self._id_of[page]

    def release(self, table: Sequence[int]) -> None:
        """A sequence gives back its pages: each no sequence holds any more is cached when
        published, else free."""
        for page in table:
            if self._refs[page] <= 0:
                raise FuselmError(f"KV page {page} released but not held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    # ---- internals ----
    def _acquire(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._cached[page]
        self._refs[page] += 1

    def _forget(self, page: int) -> None:
        """A cached page is taken for new rows: it is no longer findable (pages published under
        it become unreachable, as their parent id is gone, and age out of the cache)."""
        del self._page_of[self._key_of.pop(page)]
        del self._id_of[page]
