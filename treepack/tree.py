"""PrefixTree: the compressed trie (radix tree) of a rollout batch, as flat arrays in DFS preorder.

Legend: n = sequences, N = N_flat (their tokens), M = N_tree (trie tokens), V = compressed nodes.

Construction never walks a pointer trie. It uses three facts about the lexicographic order of the
sequences (which is a DFS leaf order of the trie, with a prefix-of-another before its extensions):
1. the trie tokens that sequence i adds are exactly ``s_i[lcp_i:]``, where lcp_i is its longest common
   prefix with the previous sequence in that order, so ``N_tree = sum(L_i - lcp_i)`` and emitting those
   suffixes in order *is* the DFS preorder layout;
2. the subtree of the token at depth d of sequence i's suffix ends where the first later sequence j with
   ``lcp_j <= d`` starts; those j are the running-minimum records of ``lcp[i+1:]``, kept on a monotonic
   stack, and each run of depths sharing one record is one compressed node;
3. the parent of a suffix's first token is the token at depth ``lcp_i - 1`` of the closest earlier
   sequence whose own suffix starts at or above that depth (a previous-smaller-value query).
Cost: one sort that yields the order and the adjacent LCPs together (``sorted_with_lcp``: rounds of
vectorised comparisons against pivots, work ~ 1.5-2 x sum(lcp) tokens + 64 n, no copy of the tokens),
and two O(n) stack passes over sequences, not tokens. Token-level arrays (M entries) are materialised
only on request.

Scopes: sharing never crosses a scope (a ``step`` of training, or a ``tree_id`` group with
``group_by="tree_id"``); each scope is its own forest inside one PrefixTree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numpy.lib.stride_tricks import as_strided

from treepack.errors import InputError
from treepack.io.rollouts import Rollouts, ranges
from treepack.io.sequences import check_token_buffer

SCOPES = ("none", "tree_id", "step")
_LCP_CHUNK = 1 << 17  # tokens per LCP slice: its 512 KB window copies stay in cache (8 MB: 1.4x slower)
_WINDOW_MIN = 64  # first LCP window (tokens), doubled while a pair stays equal (16 and 32 were no faster)
_WINDOW_MAX = 1 << 16  # widest LCP window (tokens); longer common prefixes take several
_ENDED = np.iinfo(np.int64).min  # the "token" after a sequence's end: below every token
_PACKED_KEY_LIMIT = 2**62  # (group, class) is sorted as one int64 key while it stays below this


def scope_codes(r: Rollouts, group_by: str | None = None) -> tuple[np.ndarray | None, list | None]:
    """(scope code per sequence, label per code): split by ``step`` when present, and by tree_id on request."""
    group_by = group_by or "none"
    if group_by not in SCOPES:
        raise InputError(f"group_by must be one of {', '.join(SCOPES)}, got {group_by!r}")
    parts, labels = [], []
    if r.steps is not None:
        parts.append(r.steps)
        labels.append(lambda v: "no step" if v < 0 else f"step {v}")  # -1: a record without one
    if group_by == "tree_id":
        if r.groups is None:
            raise InputError("--group-by tree_id: the input has no 'tree_id' or 'group_id' field")
        parts.append(r.groups)
        labels.append(lambda v: r.group_names[v])
    if not parts:
        return None, None
    combined = np.stack(parts, axis=1)
    uniq, codes = np.unique(combined, axis=0, return_inverse=True)
    names = [
        labels[0](int(row[0])) if len(parts) == 1 else f"{labels[0](int(row[0]))} / {labels[1](int(row[1]))}"
        for row in uniq
    ]
    return codes.reshape(-1).astype(np.int64), names


def lexicographic_order(tokens: np.ndarray, offsets: np.ndarray, scope: np.ndarray | None = None) -> np.ndarray:
    """Indices of the sequences sorted by (scope, tokens), shorter first on a tie (prefix before extension)."""
    return sorted_with_lcp(tokens, offsets, scope)[0]


def sorted_with_lcp(
    tokens: np.ndarray, offsets: np.ndarray, scope: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(order, lcp): sequences sorted by (scope, tokens) and each one's LCP with its predecessor.

    The order is lexicographic with a proper prefix before its extensions and equal sequences in input
    order; ``lcp[i]`` is the common prefix of ``order[i]`` and ``order[i-1]`` (0 at a scope start).
    A multikey quicksort that never copies the tokens: every group of sequences still tied on their first
    d tokens is split in one vectorised round against a pivot (its longest member). Each member's LCP h
    with the pivot, found by ``adjacent_lcp`` from depth d, places it: members below the pivot by
    ascending h, then the pivot and its duplicates, then members above it by descending h, ties on h by
    their token at h. Neighbours in different classes have LCP min(h, h'); a class that agrees on its
    token at h is the next round's group at depth h + 1. Each token is thus compared about once (twice
    with galloping), and the adjacent LCPs come out of the sort instead of a second pass.
    """
    tokens = np.asarray(tokens)
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    lcp = np.zeros(max(n, 0), dtype=np.int64)
    if n <= 1:
        return np.arange(n, dtype=np.int64), lcp
    starts = offsets[:-1]
    lens = np.diff(offsets)
    if scope is None:
        order = np.arange(n, dtype=np.int64)
        head = np.zeros(n, dtype=bool)
        head[0] = True
    else:
        scope = np.asarray(scope)
        order = np.argsort(scope, kind="stable").astype(np.int64)
        sorted_scope = scope[order]
        head = np.empty(n, dtype=bool)
        head[0] = True
        np.not_equal(sorted_scope[1:], sorted_scope[:-1], out=head[1:])
    # the tied members: slot in ``order``, sequence, tied depth; ``head`` marks the first of each group
    slot = np.arange(n, dtype=np.int64)
    seq = order.copy()
    depth = np.zeros(n, dtype=np.int64)
    keep = _in_groups_of_two_or_more(head)
    slot, seq, depth, head = slot[keep], seq[keep], depth[keep], head[keep]
    while len(slot):
        group = np.cumsum(head) - 1
        length = lens[seq]
        longest = np.maximum.reduceat(length, np.flatnonzero(head))
        candidates = np.flatnonzero(length == longest[group])
        first_of_group = np.ones(len(candidates), dtype=bool)
        first_of_group[1:] = group[candidates[1:]] != group[candidates[:-1]]
        pivot_member = candidates[first_of_group]
        pivot = seq[pivot_member][group]
        pivot_len = lens[pivot]
        room = np.minimum(length, pivot_len) - depth
        room[pivot_member] = 0  # the pivot against itself: known, and the longest comparison of all
        h = depth + adjacent_lcp(tokens, starts[seq] + depth, starts[pivot] + depth, room)
        h[pivot_member] = pivot_len[pivot_member]
        mine = _token_at(tokens, starts[seq], length, h)
        theirs = _token_at(tokens, starts[pivot], pivot_len, h)
        code = _class_code(h, mine, theirs)
        width = 2 * int(h.max()) + 3  # codes are in [0, width)
        if (int(group[-1]) + 1) * width < _PACKED_KEY_LIMIT:
            rank = np.lexsort((mine, group * width + code))  # one key for (group, code): half the passes
        else:
            rank = np.lexsort((mine, code, group))
        seq, h, mine, group = seq[rank], h[rank], mine[rank], group[rank]
        order[slot] = seq
        same_group = group[1:] == group[:-1]
        same_class = np.zeros(len(seq), dtype=bool)
        same_class[1:] = same_group & (h[1:] == h[:-1]) & (mine[1:] == mine[:-1])
        between = np.flatnonzero(same_group & ~same_class[1:]) + 1
        lcp[slot[between]] = np.minimum(h[between - 1], h[between])
        ended = mine == _ENDED
        duplicate = same_class & ended
        lcp[slot[duplicate]] = h[duplicate]
        head = ~same_class
        keep = _in_groups_of_two_or_more(head) & ~ended
        slot, seq, depth, head = slot[keep], seq[keep], h[keep] + 1, head[keep]
    return order, lcp


def _class_code(h: np.ndarray, mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Order of each member's class against its pivot: below it by ascending h, then the pivot and its
    duplicates, then above it by descending h (``mine``/``theirs``: the two tokens at h)."""
    top = int(h.max()) + 1
    return np.where(mine < theirs, h, np.where(mine == theirs, top, 2 * top - h))


def _in_groups_of_two_or_more(head: np.ndarray) -> np.ndarray:
    """bool mask of the members whose group (a run starting at a ``head``) has at least two members."""
    group = np.cumsum(head) - 1
    return np.bincount(group)[group] >= 2


def _token_at(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """int64 token at ``depth`` of each sequence, ``_ENDED`` (below every token) where it has ended."""
    out = np.full(len(starts), _ENDED, dtype=np.int64)
    inside = depth < lengths
    out[inside] = tokens[starts[inside] + depth[inside]]
    return out


def adjacent_lcp(tokens: np.ndarray, starts_a: np.ndarray, starts_b: np.ndarray, max_len: np.ndarray) -> np.ndarray:
    """LCP of ``tokens[starts_a[p]:]`` and ``tokens[starts_b[p]:]`` capped at ``max_len[p]``, for all pairs p.

    Galloping: compare a window of every pair still equal at once, doubling it each round (``_WINDOW_MIN``
    tokens up to ``_WINDOW_MAX``), so the work is ~2x the LCP plus 64 tokens a pair. Windows are rows of a
    sliding-window view of the token buffer: gathering a whole row is one contiguous copy (~1.5 ns a token
    from 256 tokens on) where per-token gathered indices cost ~10 ns; rows are taken ``_LCP_CHUNK`` tokens
    at a time so that the copies stay in cache. Pairs whose window would run past the end of the buffer
    (the last sequences) compare only what they have left, by gathered indices.
    """
    tokens = np.asarray(tokens)
    starts_a = np.asarray(starts_a, dtype=np.int64)
    starts_b = np.asarray(starts_b, dtype=np.int64)
    max_len = np.asarray(max_len, dtype=np.int64)
    lcp = np.zeros(len(max_len), dtype=np.int64)
    active = np.flatnonzero(max_len > 0)
    n_tokens = len(tokens)
    window = _WINDOW_MIN
    while len(active):
        w = min(window, n_tokens)
        a = starts_a[active] + lcp[active]
        b = starts_b[active] + lcp[active]
        room = max_len[active] - lcp[active]
        first = np.empty(len(active), dtype=np.int64)
        fits = np.maximum(a, b) + w <= n_tokens
        rows = np.flatnonzero(fits)
        if len(rows):
            # row i is tokens[i : i + w] (sliding_window_view without its ~17 us of checks per call)
            view = as_strided(tokens, (n_tokens - w + 1, w), (tokens.strides[0],) * 2, writeable=False)
            step = max(1, _LCP_CHUNK // w)
            for lo in range(0, len(rows), step):
                part = rows[lo : lo + step]
                differs = view[a[part]] != view[b[part]]
                at = differs.argmax(axis=1)
                at[~differs[np.arange(len(part)), at]] = w
                first[part] = at
        tail = np.flatnonzero(~fits)
        if len(tail):
            first[tail] = _first_difference(tokens, a[tail], b[tail], np.minimum(room[tail], w))
        np.minimum(first, room, out=first)
        lcp[active] += first
        active = active[(first == w) & (room > w)]
        window = min(2 * window, _WINDOW_MAX)
    return lcp


def _first_difference(tokens: np.ndarray, a: np.ndarray, b: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Index of the first difference of ``tokens[a:a+width]`` and ``tokens[b:b+width]`` (width if none)."""
    seg = np.cumsum(width) - width  # every width is >= 1
    local = np.arange(int(width.sum()), dtype=np.int64) - np.repeat(seg, width)
    differs = tokens[ranges(a, width)] != tokens[ranges(b, width)]
    return np.minimum.reduceat(np.where(differs, local, np.repeat(width, width)), seg)


@dataclass
class PrefixTree:
    """Compressed prefix trie of a batch (a forest: one tree per scope and per distinct first token).

    Sequence-level arrays are indexed by the *sorted* position i (DFS leaf order); ``order[i]`` maps back
    to the input sequence. Node-level arrays are in DFS preorder; node v owns the trie tokens
    ``[node_start[v], node_start[v] + node_len[v])`` of the layout and its subtree is the token range
    ``[node_start[v], node_end[v])``.
    """

    tokens: np.ndarray  # int32 [N] the batch's flat tokens (shared, not copied)
    offsets: np.ndarray  # int64 [n+1] the batch's offsets
    order: np.ndarray  # int64 [n] input index of the i-th sequence in DFS leaf order
    lengths: np.ndarray  # int64 [n] length of order[i]
    lcp: np.ndarray  # int64 [n] LCP of order[i] with order[i-1] (0 at a scope start)
    scope: np.ndarray  # int64 [n] scope code of order[i] (all 0 without scopes)
    seg_start: np.ndarray  # int64 [n+1] layout start of the tokens that order[i] adds (L - lcp of them)
    seg_parent: np.ndarray  # int64 [n] layout index of the parent of order[i]'s first new token (-1: root)
    node_start: np.ndarray  # int64 [V]
    node_len: np.ndarray  # int64 [V]
    node_depth: np.ndarray  # int64 [V] depth (position) of the node's first token
    node_end: np.ndarray  # int64 [V] exclusive end of the node's subtree in the layout
    node_parent: np.ndarray  # int64 [V] parent node, -1 at a root
    node_seq: np.ndarray  # int64 [V] sorted index of the sequence whose suffix holds the node
    scope_names: list | None = None  # label of each scope code (tree_id, "step 3", ...)

    # ---------------------------------------------------------------- construction

    @classmethod
    def build(cls, r: Rollouts, *, group_by: str | None = None, scope: np.ndarray | None = None) -> PrefixTree:
        """Build the trie of a batch; ``group_by="tree_id"`` gives one tree per group (see ``scope_codes``)."""
        if scope is None:
            scope, names = scope_codes(r, group_by)
        else:
            names = None
        tree = cls.from_arrays(r.tokens, r.offsets, scope)
        tree.scope_names = names
        return tree

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, offsets: np.ndarray, scope: np.ndarray | None = None) -> PrefixTree:
        """The trie of the sequences ``tokens[offsets[i]:offsets[i + 1]]`` (``scope``: int64 per sequence, as in
        `build`); a buffer the trie cannot take is refused by `check_token_buffer`."""
        tokens, offsets = np.asarray(tokens), np.asarray(offsets)
        check_token_buffer(tokens, offsets, what="PrefixTree")
        offsets = offsets.astype(np.int64, copy=False)
        if scope is not None and len(scope) != len(offsets) - 1:
            raise InputError(f"PrefixTree: scope has {len(scope):,} values for {len(offsets) - 1:,} sequences")
        n = len(offsets) - 1
        order, lcp = sorted_with_lcp(tokens, offsets, scope)
        lengths = np.diff(offsets)[order]
        sc = np.zeros(n, dtype=np.int64) if scope is None else np.asarray(scope, dtype=np.int64)[order]
        seg_len = lengths - lcp
        seg_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(seg_len, out=seg_start[1:])
        seg_parent = _segment_parents(lcp, seg_start)
        nodes = _compressed_nodes(lcp, lengths, seg_start)
        node_start, node_len, node_depth, node_end, node_seq = nodes
        # parent node: the node holding the token before a node's first token on its path
        first_tok_parent = node_start - 1
        at_seg_start = node_start == seg_start[node_seq]
        first_tok_parent[at_seg_start] = seg_parent[node_seq[at_seg_start]]
        node_parent = np.searchsorted(node_start, first_tok_parent, side="right") - 1
        node_parent[first_tok_parent < 0] = -1
        return cls(
            tokens=tokens, offsets=offsets, order=order, lengths=lengths, lcp=lcp, scope=sc,
            seg_start=seg_start, seg_parent=seg_parent, node_start=node_start, node_len=node_len,
            node_depth=node_depth, node_end=node_end, node_parent=node_parent.astype(np.int64), node_seq=node_seq,
        )

    # ---------------------------------------------------------------- sizes

    @property
    def n_sequences(self) -> int:
        return int(self.order.shape[0])

    @property
    def n_flat_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def n_tree_tokens(self) -> int:
        return int(self.seg_start[-1])

    @property
    def n_nodes(self) -> int:
        return int(self.node_start.shape[0])

    @cached_property
    def node_children(self) -> np.ndarray:
        """int64 [V] number of child nodes."""
        p = self.node_parent[self.node_parent >= 0]
        return np.bincount(p, minlength=self.n_nodes).astype(np.int64)

    @cached_property
    def is_leaf_seq(self) -> np.ndarray:
        """bool [n] sorted sequence i is a leaf: not a proper prefix of another, and the last of its duplicates."""
        n = self.n_sequences
        leaf = np.ones(n, dtype=bool)
        if n > 1:
            same = self.scope[1:] == self.scope[:-1]
            leaf[:-1] = ~(same & (self.lcp[1:] >= self.lengths[:-1]))
        return leaf

    @cached_property
    def seq_end_token(self) -> np.ndarray:
        """int64 [n] layout index of sorted sequence i's last token (a duplicate ends where its twin does)."""
        end = self.seg_start[1:] - 1
        # an empty suffix (a duplicate) ends at the previous sequence's end
        empty = self.seg_start[1:] == self.seg_start[:-1]
        if empty.any():
            idx = np.where(empty, 0, np.arange(self.n_sequences))
            np.maximum.accumulate(idx, out=idx)
            end = end[idx]
        return end

    @cached_property
    def node_count(self) -> np.ndarray:
        """int64 [V] sequences whose path passes through the node (Tree Training's gradient scale)."""
        ends = self.seq_end_token  # non-decreasing in DFS order
        return np.searchsorted(ends, self.node_end, side="left") - np.searchsorted(ends, self.node_start, side="left")

    # ---------------------------------------------------------------- token-level views (M entries)

    def token_ids(self) -> np.ndarray:
        """int32 [M] trie tokens in DFS preorder."""
        src = self.offsets[:-1][self.order] + self.lcp
        return self.tokens[ranges(src, self.lengths - self.lcp)]

    def token_depth(self) -> np.ndarray:
        """int32 [M] depth (= original position) of each trie token."""
        return ranges(self.lcp, self.lengths - self.lcp).astype(np.int32)

    def token_parent(self) -> np.ndarray:
        """int32 [M] layout index of each token's parent (-1 at roots)."""
        parent = np.arange(-1, self.n_tree_tokens - 1, dtype=np.int64)
        nonempty = self.seg_start[1:] > self.seg_start[:-1]
        parent[self.seg_start[:-1][nonempty]] = self.seg_parent[nonempty]
        return parent.astype(np.int32)

    def token_subtree_end(self) -> np.ndarray:
        """int32 [M] exclusive end of each token's subtree (mask: k <= q < subtree_end[k])."""
        return np.repeat(self.node_end, self.node_len).astype(np.int32)

    def token_count(self) -> np.ndarray:
        """int32 [M] sequences whose path contains each token."""
        return np.repeat(self.node_count, self.node_len).astype(np.int32)

    def paths(self) -> tuple[np.ndarray, np.ndarray]:
        """(seq_offsets [n+1], token_index [N]): layout indices of each sorted sequence's path, root to leaf."""
        n = self.n_sequences
        offs = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offs[1:])
        out = np.empty(int(offs[-1]), dtype=np.int64)
        prev = None
        for i in range(n):
            a, lc, L = int(offs[i]), int(self.lcp[i]), int(self.lengths[i])
            if lc:
                out[a : a + lc] = prev[:lc]
            s = int(self.seg_start[i])
            out[a + lc : a + L] = np.arange(s, s + L - lc)
            prev = out[a : a + L]
        return offs, out


def _segment_parents(lcp: np.ndarray, seg_start: np.ndarray) -> np.ndarray:
    """Layout index of the parent of each sorted sequence's first new token (-1 when lcp is 0).

    The token at depth d on sequence i's path was emitted by k = max{k <= i : lcp_k <= d}; for
    d = lcp_i - 1 that is the previous sequence with a strictly smaller lcp (monotonic stack).
    """
    n = len(lcp)
    out = np.full(n, -1, dtype=np.int64)
    lcp_l = lcp.tolist()
    start_l = seg_start.tolist()
    stack: list[int] = []  # sorted indices with strictly increasing lcp
    for i in range(n):
        li = lcp_l[i]
        while stack and lcp_l[stack[-1]] >= li:
            stack.pop()
        if li > 0:
            k = stack[-1]
            out[i] = start_l[k] + (li - 1 - lcp_l[k])
        stack.append(i)
    return out


def _compressed_nodes(lcp: np.ndarray, lengths: np.ndarray, seg_start: np.ndarray):
    """Split each sequence's suffix into compressed nodes; return node arrays in DFS preorder."""
    n = len(lcp)
    lcp_l = lcp.tolist()
    len_l = lengths.tolist()
    start_l = seg_start.tolist()
    total = start_l[-1]
    starts: list[int] = []
    lens: list[int] = []
    depths: list[int] = []
    ends: list[int] = []
    seqs: list[int] = []
    stack: list[int] = []  # running-minimum records of lcp[i+1:], top = i+1 (values strictly decrease downward)
    for i in range(n - 1, -1, -1):
        lo, upper = lcp_l[i], len_l[i]
        if upper > lo:
            base = start_l[i] - lo  # layout index of depth d in this suffix is base + d
            k = len(stack) - 1
            while True:
                if k >= 0:
                    j = stack[k]
                    v = lcp_l[j]
                    end = start_l[j]
                else:
                    v, end = -1, total
                if v > lo:
                    if v < upper:
                        starts.append(base + v)
                        lens.append(upper - v)
                        depths.append(v)
                        ends.append(end)
                        seqs.append(i)
                        upper = v
                    k -= 1
                    continue
                starts.append(base + lo)
                lens.append(upper - lo)
                depths.append(lo)
                ends.append(end)
                seqs.append(i)
                break
        while stack and lcp_l[stack[-1]] >= lcp_l[i]:
            stack.pop()
        stack.append(i)
    rev = slice(None, None, -1)
    return (
        np.asarray(starts[rev], dtype=np.int64),
        np.asarray(lens[rev], dtype=np.int64),
        np.asarray(depths[rev], dtype=np.int64),
        np.asarray(ends[rev], dtype=np.int64),
        np.asarray(seqs[rev], dtype=np.int64),
    )


class RangeMin:
    """Minimum of ``a[lo:hi]`` for many (lo, hi) pairs at once: a sparse table, O(n log n) build, O(1) a query."""

    def __init__(self, a: np.ndarray):
        a = np.asarray(a)
        self.levels = [a]  # levels[j][i] = min(a[i : i + 2**j])
        k = 1
        while 2 * k <= len(a):
            prev = self.levels[-1]
            self.levels.append(np.minimum(prev[:-k], prev[k:]))
            k *= 2

    def __call__(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        out = np.empty(len(lo), dtype=self.levels[0].dtype)
        if not len(lo):
            return out
        if np.any(hi <= lo):
            raise ValueError("RangeMin needs non-empty ranges (hi > lo)")
        j = np.frexp((hi - lo).astype(np.float64))[1] - 1  # floor(log2(length)), exact for ints < 2**53
        for level in np.unique(j).tolist():
            m = j == level
            t = self.levels[level]
            out[m] = np.minimum(t[lo[m]], t[hi[m] - (1 << level)])
        return out
