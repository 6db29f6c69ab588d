"""Cross-request suffix drafting (suffix decoding): a bounded index of recently served outputs,
global or per tenant, that proposes draft trees from what followed the context's longest suffix.
Agent traffic repeats itself across requests (a tool-call schema, a SQL skeleton, a summary
template), so outputs served minutes ago predict the next tokens of this one, at no model cost.

Owns: the document store (finished requests' output tokens), its LRU eviction by tokens, the
sorted suffix index over it, and the pure `continuation_tree` that turns continuations into a
`DraftTree`. Must not touch: models, caches, I/O. Plain Python, NumPy, and torch only for the tree.

Vocabulary. A document is one request's output tokens. An occurrence of the context's suffix s is a
position j in a document whose preceding tokens end with s and which has a next token; the tokens
from j on (at most `max_continuation`) are its continuation. The proposed tree's root is the last
token of the context (not in the tree); its nodes are the distinct prefixes of the continuations,
scored by empirical frequency: prob(node) = occurrences whose continuation passes through the
node / occurrences used. Arctic Inference's suffix tree is the reference design; this is a
suffix-array variant that is cheap to keep in NumPy.

Layout. Every position j (min_match <= j < len(doc)) is an index row keyed by its preceding tokens
read backwards, (doc[j-1], doc[j-2], ..., doc[j-max_match]), padded with 0xFFFFFFFF at the start
of the document, stored as big-endian uint32 bytes in one fixed-width void value. Sorted bytewise,
the rows whose key starts with the reversed suffix form one contiguous range, for every suffix
length at once: a lookup is a binary search over the suffix length, each probe two `searchsorted`
calls, O(log(max_match) * log(rows)); no Python loop runs over the index. Adding a document sorts
its rows and merges them in (O(rows) memmove); evicting filters rows (O(rows)).

Use and memory. `add` counts as use and so does `propose`: the documents a proposal drew on get
a fresh use stamp. Over `max_tokens` (or a tenant's `max_tokens_per_tenant`) the least recently
used documents go first. Per held token: 8 bytes in the token arena plus one index row of
4 * max_match + 16 bytes (56 bytes at max_match 8: about 15 MB for the default 262,144 tokens); the
arena is compacted when evicted tokens outnumber max(held, 4096), so it stays under
2 x (held + max(held, 4096)) tokens. A proposal merges at most `max_occurrences` continuations
(the most recently added documents first), so the tree's cost does not grow with the index.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.tree import DraftTree

_PAD = 0xFFFFFFFF  # key filler before a document's first token; never a token id
_MAX_TOKEN_ID = 2**31 - 1
_GLOBAL = ""  # the one partition when tenants share the pool


class SuffixIndexConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(262_144, ge=1, le=1 << 26, description="memory bound: output tokens held in all")
    max_tokens_per_tenant: Optional[int] = Field(
        None, ge=1, le=1 << 26, description="cap on one tenant's tokens (None: only max_tokens)")
    max_match: int = Field(8, ge=1, le=32, description="longest suffix of the context matched")
    min_match: int = Field(2, ge=1, le=32, description="shortest suffix that may propose a draft")
    max_continuation: int = Field(16, ge=1, le=256, description="tokens per continuation (tree depth)")
    max_occurrences: int = Field(32, ge=1, le=65_536,
                                 description="occurrences merged per proposal (most recent documents first)")
    tenant_isolation: bool = Field(
        True, description="True: a tenant's queries see only its own outputs; False: one pool shared by all")

    @model_validator(mode="after")
    def _check(self) -> "SuffixIndexConfig":
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) must be <= max_match ({self.max_match})")
        return self


@dataclass(frozen=True)
class SuffixIndexStats:
    documents: int
    tokens_held: int
    index_rows: int
    tenants: int
    memory_bytes: int  # token arena + index arrays (allocated)
    proposals: int  # propose() calls
    hits: int  # proposals that returned a tree
    added: int  # documents added since construction
    evicted: int  # documents evicted (LRU or forget)


@dataclass
class _Partition:
    keys: np.ndarray  # [R] void(4 * max_match): reversed preceding tokens, big-endian, sorted
    row_slot: np.ndarray  # [R] int64 document slot
    row_pos: np.ndarray  # [R] int64 position of the next token in its document


def continuation_tree(continuations: np.ndarray, max_nodes: int) -> DraftTree | None:
    """continuations: [M, C] int64 token ids, -1 padding after a row's end (each row non-empty).

    The trie of the rows' prefixes, nodes scored by prob = rows through the node / M; the best
    `max_nodes` nodes by prob (ties: shallower, then lexicographically smaller) are kept, which is
    ancestor-closed since a child never has more rows than its parent. Returned in topological order
    (by depth, then prob); scores = log prob, logprobs = log(prob / parent prob). None when M == 0.

    Vectorised: sorted rows put every trie node's rows in one run; a row opens a run at depth d when
    it shares fewer than d + 1 tokens with the row above. A constant number of NumPy calls."""
    m, c = continuations.shape
    if m == 0 or c == 0 or max_nodes < 1:
        return None
    rows = np.ascontiguousarray((continuations + 1).astype(">u4")).view(f"V{4 * c}").ravel()  # pad -1 -> 0
    s = continuations[np.argsort(rows, kind="stable")]  # rows in lexicographic order, shorter first
    valid = s >= 0  # [M, C]
    same = np.zeros((m, c + 1), dtype=bool)
    same[1:, :c] = (s[1:] == s[:-1]) & valid[1:]
    lcp = same.argmin(axis=1)  # [M] tokens shared with the row above (0 for the first row)
    depth = np.arange(c)
    opens = lcp[:, None] <= depth  # [M, C] row r opens a run at depth d
    run = np.cumsum(opens, axis=0) + (depth * m - 1)  # [M, C] run id, unique over depths
    size = np.bincount(run.ravel(), minlength=m * c + 1)  # rows per run
    size[-1] = m  # the last: the root's
    r, d = np.nonzero(opens & valid)  # one (r, d) per trie node
    cnt = size[run[r, d]]
    if r.size > max_nodes:
        keep = np.argsort(((m - cnt) * c + d) * m + r, kind="stable")[:max_nodes]  # prob, shallower, prefix
        r, d, cnt = r[keep], d[keep], cnt[keep]
    topo = np.argsort((d * (m + 1) + (m - cnt)) * m + r, kind="stable")  # parents before children
    r, d, cnt = r[topo], d[topo], cnt[topo]
    node_of_run = np.full(m * c + 1, -1, dtype=np.int64)  # the last: the root
    node_of_run[run[r, d]] = np.arange(r.size)
    parent_run = np.where(d > 0, run[r, d - 1], m * c)  # d - 1 = -1 wraps harmlessly where d == 0
    return DraftTree(
        tokens=torch.from_numpy(s[r, d].astype(np.int64, copy=False)),
        parents=torch.from_numpy(node_of_run[parent_run]),
        depths=torch.from_numpy((d + 1).astype(np.int64, copy=False)),
        scores=torch.from_numpy(np.log(cnt / m).astype(np.float32)),
        logprobs=torch.from_numpy(np.log(cnt / size[parent_run]).astype(np.float32)),
    )


class SuffixIndex:
    """Recently served outputs, searchable by suffix. Thread-safe: every public method holds a lock
    (the engine proposes from its thread while a server may add from another).

    Documents live in slots (reused after eviction): per-slot arrays of arena start, length, last
    use and add serial, so a proposal gathers continuations and marks use without a Python loop."""

    def __init__(self, config: SuffixIndexConfig | None = None) -> None:
        self.config = config or SuffixIndexConfig()
        self._key_dtype = np.dtype(f"V{4 * self.config.max_match}")
        self._lock = threading.RLock()
        self._partitions: dict[str, _Partition] = {}
        self._arena = np.zeros(1024, dtype=np.int64)  # document tokens, back to back
        self._arena_used = 0
        self._slot_tenant: list[str | None] = []  # None: a free slot
        self._slot_start = np.zeros(0, dtype=np.int64)  # [S] arena offset
        self._slot_len = np.zeros(0, dtype=np.int64)  # [S] tokens
        self._slot_used = np.zeros(0, dtype=np.int64)  # [S] clock of the last add or proposal drawing on it
        self._slot_added = np.zeros(0, dtype=np.int64)  # [S] add serial (recency of the document)
        self._free: list[int] = []
        self._tenant_slots: dict[str, set[int]] = {}
        self._tenant_tokens: dict[str, int] = {}
        self._tokens_held = self._documents = self._clock = 0
        self._proposals = self._hits = self._added = self._evicted = 0

    # ---- reading -------------------------------------------------------------------------------
    @property
    def tokens_held(self) -> int:
        return self._tokens_held

    @property
    def documents(self) -> int:
        return self._documents

    def stats(self) -> SuffixIndexStats:
        with self._lock:
            parts = self._partitions.values()
            slot_bytes = sum(a.nbytes for a in (self._slot_start, self._slot_len, self._slot_used, self._slot_added))
            return SuffixIndexStats(
                documents=self._documents, tokens_held=self._tokens_held,
                index_rows=sum(p.keys.size for p in parts), tenants=len(self._tenant_slots),
                memory_bytes=self._arena.nbytes + slot_bytes
                + sum(p.keys.nbytes + p.row_slot.nbytes + p.row_pos.nbytes for p in parts),
                proposals=self._proposals, hits=self._hits, added=self._added, evicted=self._evicted)

    def propose(self, context: Sequence[int] | np.ndarray | torch.Tensor, max_nodes: int,
                tenant: str = "default") -> DraftTree | None:
        """The continuation tree of the longest suffix of `context` (max_match down to min_match
        tokens) found in the outputs visible to `tenant`; None when no suffix recurs. The documents
        drawn on count as used (LRU)."""
        cfg = self.config
        tail = context[-cfg.max_match:]
        tail = tail.tolist() if isinstance(tail, (np.ndarray, torch.Tensor)) else list(tail)
        if max_nodes < 1 or len(tail) < cfg.min_match:
            return None
        query = np.asarray(tail[::-1], dtype=">u4").tobytes()  # the suffix read backwards
        with self._lock:
            self._proposals += 1
            part = self._partitions.get(self._partition_of(tenant))
            if part is None:
                return None
            lo, hi = self._longest_match(part.keys, query)
            if hi <= lo:
                return None
            slots, pos = part.row_slot[lo:hi], part.row_pos[lo:hi]
            if hi - lo > cfg.max_occurrences:  # the most recently added documents, then latest positions
                recent = np.argpartition(-(self._slot_added[slots] * (1 << 31) + pos), cfg.max_occurrences - 1)
                slots, pos = slots[recent[: cfg.max_occurrences]], pos[recent[: cfg.max_occurrences]]
            at = (self._slot_start[slots] + pos)[:, None] + np.arange(min(cfg.max_continuation, max_nodes))
            inside = at < (self._slot_start[slots] + self._slot_len[slots])[:, None]
            conts = np.where(inside, self._arena[np.minimum(at, self._arena_used - 1)], -1)  # [M, C]
            self._clock += 1
            self._slot_used[slots] = self._clock
            self._hits += 1
        return continuation_tree(conts, max_nodes)

    def _partition_of(self, tenant: str) -> str:
        return tenant if self.config.tenant_isolation else _GLOBAL

    def _range(self, keys: np.ndarray, query: bytes, length: int) -> tuple[int, int]:
        """Rows whose key starts with the first `length` tokens of `query`: [lo, hi)."""
        q, rest = query[: 4 * length], self._key_dtype.itemsize - 4 * length
        lo = int(np.searchsorted(keys, np.frombuffer(q + b"\x00" * rest, dtype=self._key_dtype)[0], "left"))
        hi = int(np.searchsorted(keys, np.frombuffer(q + b"\xff" * rest, dtype=self._key_dtype)[0], "right"))
        return lo, hi

    def _longest_match(self, keys: np.ndarray, query: bytes) -> tuple[int, int]:
        """The rows of the longest suffix found: in a sorted array the key sharing the longest prefix
        with the query is next to the query's insertion point (the suffix-array LCP argument)."""
        n = len(query) // 4
        at = int(np.searchsorted(keys, np.frombuffer(query + b"\x00" * (self._key_dtype.itemsize - 4 * n),
                                                       dtype=self._key_dtype)[0], "left"))
        best = 0
        for row in (at - 1, at):
            if 0 <= row < keys.size:
                key = keys[row].tobytes()
                shared = n if key.startswith(query) else 0
                while shared < n and key[4 * shared : 4 * shared + 4] == query[4 * shared : 4 * shared + 4]:
                    shared += 1
                best = max(best, shared)
        if best < self.config.min_match:
            return 0, 0
        return self._range(keys, query, best)

    # ---- writing -------------------------------------------------------------------------------
    def add(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, tenant: str = "default") -> bool:
        """Index one finished request's output tokens as a document (the first max_tokens of them,
        or the tenant cap); False when it is too short to hold a match and a next token."""
        cfg = self.config
        toks = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
        toks = toks.astype(np.int64, copy=False).ravel()
        if toks.size and (toks.min() < 0 or toks.max() > _MAX_TOKEN_ID):
            raise ValueError(f"token ids must lie in [0, {_MAX_TOKEN_ID}]")
        toks = toks[: min(cfg.max_tokens, cfg.max_tokens_per_tenant or cfg.max_tokens)]
        if toks.size <= cfg.min_match:
            return False
        with self._lock:
            slot = self._new_slot()
            self._clock += 1
            self._slot_tenant[slot] = tenant
            self._slot_start[slot] = self._store(toks)
            self._slot_len[slot], self._slot_used[slot], self._slot_added[slot] = toks.size, self._clock, self._added
            self._tenant_slots.setdefault(tenant, set()).add(slot)
            self._tenant_tokens[tenant] = self._tenant_tokens.get(tenant, 0) + int(toks.size)
            self._tokens_held += int(toks.size)
            self._documents += 1
            self._added += 1
            self._insert_rows(self._partition_of(tenant), slot, toks)
            self._evict(tenant)
        return True

    def warm(self, records: Iterable[TraceRecord]) -> int:
        """Add the generated tokens of each consenting record (each contiguous run of loss_mask 1
        is one document, so turns of a multi-turn record are never joined); documents added."""
        added = 0
        for rec in records:
            if not rec.capture_consent:
                continue
            run: list[int] = []
            for tok, gen in zip(list(rec.input_ids) + [0], list(rec.loss_mask) + [0]):
                if gen:
                    run.append(tok)
                elif run:
                    added += self.add(run, rec.tenant)
                    run = []
        return added

    def forget(self, tenant: str) -> int:
        """Drop every document of `tenant` (e.g. a consent withdrawal); documents dropped."""
        with self._lock:
            gone = sorted(self._tenant_slots.get(tenant, ()))
            self._drop(gone)
            return len(gone)

    def _new_slot(self) -> int:
        if self._free:
            return self._free.pop()
        n = len(self._slot_tenant)
        if n == self._slot_start.size:
            grow = max(64, n)
            self._slot_start, self._slot_len, self._slot_used, self._slot_added = (
                np.concatenate([a, np.zeros(grow, dtype=np.int64)])
                for a in (self._slot_start, self._slot_len, self._slot_used, self._slot_added))
        self._slot_tenant.append(None)
        return n

    def _store(self, toks: np.ndarray) -> int:
        """Append to the arena (compacting it first when evicted tokens outnumber held ones)."""
        if self._arena_used - self._tokens_held > max(self._tokens_held, 4096):
            live = [i for i, t in enumerate(self._slot_tenant) if t is not None]
            packed = [self._arena[self._slot_start[i] : self._slot_start[i] + self._slot_len[i]] for i in live]
            packed = np.concatenate(packed) if packed else np.zeros(0, dtype=np.int64)
            if live:
                self._slot_start[live] = np.cumsum(self._slot_len[live]) - self._slot_len[live]
            self._arena[: packed.size] = packed
            self._arena_used = int(packed.size)
        need = self._arena_used + toks.size
        if need > self._arena.size:
            grown = np.zeros(max(need, 2 * self._arena.size), dtype=np.int64)
            grown[: self._arena_used] = self._arena[: self._arena_used]
            self._arena = grown
        start = self._arena_used
        self._arena[start:need] = toks
        self._arena_used = need
        return start

    def _insert_rows(self, name: str, slot: int, toks: np.ndarray) -> None:
        """Merge the document's rows (positions min_match .. len-1) into the sorted partition."""
        k, lo = self.config.max_match, self.config.min_match
        padded = np.concatenate([np.full(k, _PAD, dtype=np.int64), toks])
        windows = np.lib.stride_tricks.sliding_window_view(padded, k)[lo : toks.size]  # doc[j-k:j], j = lo..
        keys = np.ascontiguousarray(windows[:, ::-1].astype(">u4")).view(self._key_dtype).ravel()
        order = np.argsort(keys, kind="stable")
        keys, pos = keys[order], np.arange(lo, toks.size, dtype=np.int64)[order]
        part = self._partitions.get(name)
        if part is None:
            self._partitions[name] = _Partition(keys, np.full(keys.size, slot, dtype=np.int64), pos)
            return
        at = np.searchsorted(part.keys, keys, "left")
        part.keys = np.insert(part.keys, at, keys)
        part.row_slot = np.insert(part.row_slot, at, slot)
        part.row_pos = np.insert(part.row_pos, at, pos)

    def _least_recent(self, slots: Iterable[int], tokens: int) -> list[int]:
        """The least recently used of `slots` that together hold at least `tokens` tokens."""
        if tokens <= 0:
            return []
        cand = np.fromiter(slots, dtype=np.int64)
        cand = cand[np.argsort(self._slot_used[cand], kind="stable")]
        upto = int(np.searchsorted(np.cumsum(self._slot_len[cand]), tokens, "left"))
        return cand[: upto + 1].tolist()

    def _evict(self, tenant: str) -> None:
        """Least recently used documents out until the tenant cap and max_tokens hold."""
        cap = self.config.max_tokens_per_tenant
        if cap is not None:
            self._drop(self._least_recent(self._tenant_slots[tenant], self._tenant_tokens[tenant] - cap))
        live = (i for i, t in enumerate(self._slot_tenant) if t is not None)
        self._drop(self._least_recent(live, self._tokens_held - self.config.max_tokens))

    def _drop(self, gone: list[int]) -> None:
        by_partition: dict[str, list[int]] = {}
        for slot in gone:
            tenant = self._slot_tenant[slot]
            length = int(self._slot_len[slot])
            self._tenant_slots[tenant].discard(slot)
            self._tenant_tokens[tenant] -= length
            if not self._tenant_slots[tenant]:
                del self._tenant_slots[tenant], self._tenant_tokens[tenant]
            self._slot_tenant[slot] = None
            self._free.append(slot)
            self._tokens_held -= length
            self._documents -= 1
            by_partition.setdefault(self._partition_of(tenant), []).append(slot)
        for name, slots in by_partition.items():
            part = self._partitions[name]
            keep = ~np.isin(part.row_slot, slots)
            part.keys, part.row_slot, part.row_pos = part.keys[keep], part.row_slot[keep], part.row_pos[keep]
            if part.keys.size == 0:
                del self._partitions[name]
        self._evicted += len(gone)
