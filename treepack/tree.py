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
Cost: one sort of n byte strings (memcmp; the Python key objects hold a big-endian copy of the tokens),
LCPs by galloping vectorised comparison (work ~ 2 x sum(lcp) + 16 n), and two O(n) stack passes over
sequences, not tokens. Token-level arrays (M entries) are materialised only on request.

Scopes: sharing never crosses a scope (a ``step`` of training, or a ``tree_id`` group with
``group_by="tree_id"``); each scope is its own forest inside one PrefixTree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from treepack.errors import InputError
from treepack.rollouts import Rollouts, _ranges

SCOPES = ("none", "tree_id", "step")
_KEY_CHUNK = 1 << 22  # tokens converted to big-endian bytes at a time (bounds the temporary copy)
_LCP_CHUNK = 1 << 22  # compared tokens per vectorised LCP slice (bounds the index temporaries)
_GALLOP_MAX = 256  # widest vectorised LCP window; longer common prefixes are finished pair by pair


def scope_codes(r: Rollouts, group_by: str | None = None) -> tuple[np.ndarray | None, list | None]:
    """(scope code per sequence, label per code): split by ``step`` when present, and by tree_id on request."""
    group_by = group_by or "none"
    if group_by not in SCOPES:
        raise InputError(f"group_by must be one of {', '.join(SCOPES)}, got {group_by!r}")
    parts, labels = [], []
    if r.steps is not None:
        parts.append(r.steps)
        labels.append(lambda v: f"step {v}")
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
    n = len(offsets) - 1
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    keys: list[bytes] = [b""] * n
    head = None if scope is None else scope.astype(">u8")
    i = 0
    while i < n:
        j = int(np.searchsorted(offsets, offsets[i] + _KEY_CHUNK, side="right")) - 1
        j = max(j, i + 1)
        base = int(offsets[i])
        buf = tokens[base : int(offsets[j])].astype(">u4").tobytes()
        for s in range(i, j):
            a, b = (int(offsets[s]) - base) * 4, (int(offsets[s + 1]) - base) * 4
            keys[s] = buf[a:b] if head is None else head[s].tobytes() + buf[a:b]
        i = j
    order = sorted(range(n), key=keys.__getitem__)
    return np.asarray(order, dtype=np.int64)


def adjacent_lcp(tokens: np.ndarray, starts_a: np.ndarray, starts_b: np.ndarray, max_len: np.ndarray) -> np.ndarray:
    """LCP of ``tokens[starts_a[p]:]`` and ``tokens[starts_b[p]:]`` capped at ``max_len[p]``, for all pairs p.

    Two phases. Galloping first: compare a window of 16 tokens of every pair at once (gathered indices),
    keep the pairs that matched the whole window and double it, up to ``_GALLOP_MAX``; most pairs end here
    (work ~2x their LCP + 16). The pairs still equal share long prefixes (system prompts, conversation
    histories): for them gathered indices would cost ~10 ns a token, so each is finished by comparing
    contiguous slices in doubling blocks (~1 ns a token plus a few microseconds a pair). On the real
    tau-bench file (6.1M shared tokens over 1,786 pairs) this took LCPs from 110 ms to 18 ms.
    """
    m = len(max_len)
    lcp = np.zeros(m, dtype=np.int64)
    pos = np.zeros(m, dtype=np.int64)
    active = np.flatnonzero(max_len > 0)
    window = 16
    while len(active) and window <= _GALLOP_MAX:
        w_all = np.minimum(window, max_len[active] - pos[active])
        bounds = np.searchsorted(np.cumsum(w_all), np.arange(_LCP_CHUNK, int(w_all.sum()), _LCP_CHUNK))
        still = []
        for part, w in zip(np.split(active, bounds), np.split(w_all, bounds)):
            if not len(part):
                continue
            ia = _ranges(starts_a[part] + pos[part], w)
            ib = _ranges(starts_b[part] + pos[part], w)
            seg = np.cumsum(w) - w
            local = np.arange(len(ia), dtype=np.int64) - np.repeat(seg, w)
            cand = np.where(tokens[ia] != tokens[ib], local, np.repeat(w, w))
            first = np.minimum.reduceat(cand, seg)
            lcp[part] += first
            pos[part] += w
            still.append(part[(first == w) & (pos[part] < max_len[part])])
        active = np.concatenate(still) if still else active[:0]
        window *= 2
    for p in active.tolist():
        a, b, at, end = int(starts_a[p]), int(starts_b[p]), int(pos[p]), int(max_len[p])
        block = 4096
        while at < end:
            stop = min(end, at + block)
            neq = tokens[a + at : a + stop] != tokens[b + at : b + stop]
            k = int(neq.argmax())
            if neq[k]:
                at += k
                break
            at = stop
            block *= 2
        lcp[p] = at
    return lcp


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
    def build(cls, r: Rollouts, *, group_by: str | None = None, scope: np.ndarray | None = None) -> "PrefixTree":
        """Build the trie of a batch; ``group_by="tree_id"`` gives one tree per group (see ``scope_codes``)."""
        if scope is None:
            scope, names = scope_codes(r, group_by)
        else:
            names = None
        tree = cls.from_arrays(r.tokens, r.offsets, scope)
        tree.scope_names = names
        return tree

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, offsets: np.ndarray, scope: np.ndarray | None = None) -> "PrefixTree":
        tokens = np.asarray(tokens)
        offsets = np.asarray(offsets, dtype=np.int64)
        n = len(offsets) - 1
        order = lexicographic_order(tokens, offsets, scope)
        lens_in = np.diff(offsets)
        lengths = lens_in[order]
        starts = offsets[:-1][order]
        sc = np.zeros(n, dtype=np.int64) if scope is None else np.asarray(scope, dtype=np.int64)[order]
        lcp = np.zeros(n, dtype=np.int64)
        if n > 1:
            same = sc[1:] == sc[:-1]
            cap = np.where(same, np.minimum(lengths[1:], lengths[:-1]), 0)
            lcp[1:] = adjacent_lcp(tokens, starts[:-1], starts[1:], cap)
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
        return self.tokens[_ranges(src, self.lengths - self.lcp)]

    def token_depth(self) -> np.ndarray:
        """int32 [M] depth (= original position) of each trie token."""
        return _ranges(self.lcp, self.lengths - self.lcp).astype(np.int32)

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
