"""Packers: the forest (a PrefixTree as ranks, O(1) LCPs, exact pack costs) and one-pass labellings of it.

Each packer maps every rank to a pack: first-fit, dfs (next-fit of a DFS order), the optimal contiguous cut
of an order, bottom-up bins. They live apart from ``treepack.pack.strategies`` because that module composes them:
its entry points, and the strategies that search over these labellings (``best``, ``optimal``, with
``treepack.pack.multipath``'s DP; the two call each other, so they stay together there). Only numpy here. The
cost model and the measurements are in ``treepack.pack.strategies``'s docstring.

Legend: n = sequences, V = compressed trie nodes, P = packs, C = capacity (tokens).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable

import numpy as np

from treepack.tree import PrefixTree

# --------------------------------------------------------------------------------------------------
# The forest: ranks, LCP queries, nodes, and the exact cost of any packing


class _SparseTable:
    """Range minimum (or maximum) of a fixed int array in O(1) per query, vectorised over queries."""

    def __init__(self, a: np.ndarray, op: Callable = np.minimum):
        a = np.asarray(a, dtype=np.int32)  # lengths and LCPs fit; halves the n log n table
        self.op = op
        self.levels = [a]
        k = 1
        while 2 * k <= len(a):
            prev = self.levels[-1]
            self.levels.append(op(prev[:-k], prev[k:]))
            k *= 2

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """op over ``a[lo:hi]`` for each pair (hi > lo)."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        span = hi - lo
        k = np.zeros(len(span), dtype=np.int64)
        if len(span):
            k = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
            k[(1 << k) > span] -= 1  # float rounding guard
        out = np.empty(len(span), dtype=np.int64)
        for level in np.unique(k):
            sel = k == level
            tab = self.levels[int(level)]
            out[sel] = self.op(tab[lo[sel]], tab[hi[sel] - (1 << int(level))])
        return out


class Forest:
    """A PrefixTree seen by the packers: ranks, batches (steps), LCP of any two ranks, node paths."""

    def __init__(self, tree: PrefixTree, batch: np.ndarray, capacity: int):
        self.t = tree
        self.C = int(capacity)
        self.n = tree.n_sequences
        self.L = tree.lengths
        self.lcp = tree.lcp
        codes = np.unique(batch, return_inverse=True)[1] if self.n else np.zeros(0, np.int64)
        self.batch = codes.reshape(-1).astype(np.int64)  # step code of each rank, non-decreasing
        self.batch_bounds = (np.flatnonzero(np.r_[True, self.batch[1:] != self.batch[:-1], True]) if self.n
                             else np.zeros(1, np.int64))  # ranks [bounds[b], bounds[b+1]) are step b
        self._rmq: _SparseTable | None = None

    # ---------------------------------------------------------------- LCP and costs

    @property
    def rmq(self) -> _SparseTable:
        if self._rmq is None:
            self._rmq = _SparseTable(self.lcp)
        return self._rmq

    def lcp_of(self, r: np.ndarray, s: np.ndarray) -> np.ndarray:
        """LCP of the sequences of ranks r and s (elementwise; r != s); 0 across scopes."""
        r = np.asarray(r, dtype=np.int64)
        s = np.asarray(s, dtype=np.int64)
        lo, hi = np.minimum(r, s), np.maximum(r, s)
        out = np.empty(len(r), dtype=np.int64)
        adj = hi == lo + 1
        out[adj] = self.lcp[hi[adj]]
        far = ~adj
        if far.any():
            out[far] = self.rmq.query(lo[far] + 1, hi[far] + 1)
        return out

    def order_lcp(self, perm: np.ndarray) -> np.ndarray:
        """LCP of each sequence of an order with the previous one (0 at the start of a batch)."""
        out = np.zeros(len(perm), dtype=np.int64)
        if len(perm) > 1:
            out[1:] = self.lcp_of(perm[:-1], perm[1:])
            out[1:][self.batch[perm[1:]] != self.batch[perm[:-1]]] = 0
        return out

    def packs_of(self, labels: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """(ranks of each pack in DFS order, its union-trie tokens, its attention pairs); checks the capacity.

        A member's new tokens are those below its LCP with the previous member (by rank); a token at depth
        d attends to its d + 1 ancestors-or-self, so a member adds (L(L+1) - lcp(lcp+1)) / 2 pairs.
        """
        if self.n == 0:
            return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
        labels = np.asarray(labels, dtype=np.int64)
        if len(labels) != self.n or labels.min() < 0:
            raise AssertionError("every sequence must be in exactly one pack")
        idx = np.lexsort((np.arange(self.n), labels))
        lab = labels[idx]
        n_packs = int(lab[-1]) + 1
        shared = np.zeros(self.n, dtype=np.int64)
        same = lab[1:] == lab[:-1]
        if same.any():
            shared[1:][same] = self.lcp_of(idx[:-1][same], idx[1:][same])
        tokens = np.bincount(lab, weights=self.L[idx] - shared, minlength=n_packs).astype(np.int64)
        bounds = np.searchsorted(lab, np.arange(n_packs + 1))
        if np.any(bounds[1:] == bounds[:-1]):
            raise AssertionError("pack labels must be 0..P-1 with no empty pack")
        if tokens.max() > self.C:
            raise AssertionError(f"a pack has {int(tokens.max())} tokens > capacity {self.C}")
        if np.any(self.batch[idx][1:][same] != self.batch[idx][:-1][same]):
            raise AssertionError("a pack crosses a step")
        Ls = self.L[idx]
        pairs = np.bincount(lab, weights=(Ls * (Ls + 1) - shared * (shared + 1)) // 2, minlength=n_packs)
        return [idx[bounds[p] : bounds[p + 1]] for p in range(n_packs)], tokens, pairs.astype(np.int64)

    def cost(self, labels: np.ndarray) -> np.ndarray:
        """Union-trie tokens per batch (int64 [n_batches]) of a labelling (no capacity check)."""
        idx = np.lexsort((np.arange(self.n), labels))
        lab = labels[idx]
        shared = np.zeros(self.n, dtype=np.int64)
        same = lab[1:] == lab[:-1]
        shared[1:][same] = self.lcp_of(idx[:-1][same], idx[1:][same])
        return np.bincount(self.batch[idx], weights=self.L[idx] - shared).astype(np.int64)

    # ---------------------------------------------------------------- nodes

    @property
    def end_node(self) -> np.ndarray:
        """int64 [n] the node holding each sequence's last token (sequences end at node ends)."""
        if not hasattr(self, "_end_node"):
            self._end_node = np.searchsorted(self.t.node_start, self.t.seq_end_token, side="right") - 1
        return self._end_node

    @property
    def end_depth(self) -> np.ndarray:
        """int64 [V] depth just below each node: tokens on the path from the root through the node."""
        return self.t.node_depth + self.t.node_len

    def node_batch(self) -> np.ndarray:
        return self.batch[self.t.node_seq]

    def subtree_end_node(self) -> np.ndarray:
        """int64 [V] exclusive end of each node's subtree in node (preorder) indices."""
        return np.searchsorted(self.t.node_start, self.t.node_end, side="left")

    def dfs_order(self, key: np.ndarray) -> np.ndarray:
        """A DFS leaf order with each node's children (and each batch's roots) sorted by ``key`` ascending.

        Ties keep the lexicographic order; sequences ending at a node come before its children. The
        position of a node is the sum, over its ancestors and itself, of what precedes it among its
        siblings: a difference array over preorder subtree ranges, so everything is vectorised.
        """
        t = self.t
        V = t.n_nodes
        parent = t.node_parent
        count = t.node_count
        ends_at = np.bincount(self.end_node, minlength=V)
        roots = parent < 0
        group = np.where(roots, -1 - self.node_batch(), parent)
        order = np.lexsort((np.arange(V), key, group))
        g = group[order]
        c = count[order]
        csum = np.cumsum(c) - c
        first = np.r_[True, g[1:] != g[:-1]]
        start_of_group = np.maximum.accumulate(np.where(first, np.arange(V), 0))
        off = np.empty(V, dtype=np.int64)
        off[order] = csum - csum[start_of_group]
        batch_first = self.batch_bounds[:-1]
        base = np.where(roots, batch_first[self.node_batch()], ends_at[np.maximum(parent, 0)])
        local = base + off
        sub_end = self.subtree_end_node()
        diff = np.bincount(np.arange(V), weights=local, minlength=V + 1) - np.bincount(sub_end, weights=local, minlength=V + 1)
        pos = np.cumsum(diff)[:V].astype(np.int64)
        en = self.end_node
        seq_pos = pos[en] + (np.arange(self.n) - np.searchsorted(en, en, side="left"))
        perm = np.empty(self.n, dtype=np.int64)
        perm[seq_pos] = np.arange(self.n)
        return perm

    def subtree_max_length(self) -> np.ndarray:
        """int64 [V] longest sequence in each node's subtree (its deepest leaf)."""
        lo = self.t.node_seq
        return _SparseTable(self.L, np.maximum).query(lo, lo + self.t.node_count)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.t.n_nodes)]
        for v, p in enumerate(self.t.node_parent.tolist()):
            if p >= 0:
                kids[p].append(v)
        return kids


# --------------------------------------------------------------------------------------------------
# first-fit (AReaL)


def first_fit_labels(f: Forest, input_order: np.ndarray | None = None) -> np.ndarray:
    """AReaL's greedy trie packing, exactly: each sequence (in input order) into the first pack it fits."""
    t = f.t
    C = f.C
    if input_order is None:
        input_order = np.argsort(t.order, kind="stable")  # rank of input 0, 1, 2, ...
    parent = t.node_parent.tolist()
    end_depth = f.end_depth.tolist()
    end_node = f.end_node.tolist()
    L = f.L.tolist()
    batch = f.batch.tolist()
    n_batches = len(f.batch_bounds) - 1
    present: list[set | None] = [None] * t.n_nodes  # packs that hold a sequence of the node's subtree
    floor = [0] * t.n_nodes  # a lower bound on the loads of those packs (loads only grow): skips most scans
    loads = [np.zeros(f.batch_bounds[b + 1] - f.batch_bounds[b], dtype=np.int64) for b in range(n_batches)]
    n_packs = [0] * n_batches
    local = np.empty(f.n, dtype=np.int64)
    for i in input_order.tolist():
        b = batch[i]
        P = n_packs[b]
        load = loads[b]
        Li = L[i]
        path = []
        v = end_node[i]
        while v >= 0:
            path.append(v)
            v = parent[v]
        path.reverse()
        best = P
        if P:
            # levels whose subtree every pack touches share the same prefix with every pack: one argmax
            j0 = -1
            while j0 + 1 < len(path) and present[path[j0 + 1]] is not None and len(present[path[j0 + 1]]) == P:
                j0 += 1
            thr = C - Li + (end_depth[path[j0]] if j0 >= 0 else 0)
            hit = load[:P] <= thr
            k = int(hit.argmax())
            if hit[k]:
                best = k
            # deeper levels: the packs sharing more with s, deepest first (a pack's deepest level decides)
            seen_size = 0
            for j in range(len(path) - 1, j0, -1):
                v = path[j]
                s = present[v]
                if s is None or len(s) == seen_size:
                    continue
                seen_size = len(s)
                thr = C - Li + end_depth[v]
                if floor[v] > thr:
                    continue
                if len(s) > 32:  # big set: the few packs below `best` with room, then membership
                    for p in np.flatnonzero(load[:best] <= thr).tolist():
                        if p in s:
                            best = p
                            break
                else:
                    lo = None
                    for p in s:
                        lp = load[p]
                        if lo is None or lp < lo:
                            lo = lp
                        if p < best and lp <= thr:
                            best = p
                    floor[v] = int(lo)
        if best == P:
            n_packs[b] = P + 1
            load[best] = Li
        else:
            shared = 0
            for v in reversed(path):  # deepest ancestor whose subtree the pack already touches
                s = present[v]
                if s is not None and best in s:
                    shared = end_depth[v]
                    break
            load[best] += Li - shared
        local[i] = best
        new_load = int(load[best])
        for v in reversed(path):
            s = present[v]
            if s is None:
                present[v] = {best}
                floor[v] = new_load
            elif best in s:
                break
            else:
                s.add(best)
                floor[v] = min(floor[v], new_load)
    return _globalize(f, local, n_packs)


def _globalize(f: Forest, local: np.ndarray, n_packs: list[int]) -> np.ndarray:
    """Per-batch pack numbers -> global ones (batches in order)."""
    offset = np.cumsum([0] + n_packs[:-1])
    return local + np.asarray(offset, dtype=np.int64)[f.batch]


# --------------------------------------------------------------------------------------------------
# dfs (Tree Training) and contiguous cuts of an order


def dfs_order_deepest_first(f: Forest) -> np.ndarray:
    """Tree Training's traversal: children with the deepest leaf first (so similar depths stay together)."""
    return f.dfs_order(-f.subtree_max_length())


def dfs_labels(f: Forest) -> np.ndarray:
    """Tree Training's packing: one DFS traversal, a new pack whenever the next sequence would overflow."""
    perm = dfs_order_deepest_first(f)
    return next_fit(f, perm)


def next_fit(f: Forest, perm: np.ndarray) -> np.ndarray:
    """Greedy cut of an order: close the pack when the next sequence's new tokens do not fit."""
    add = (f.L[perm] - f.order_lcp(perm)).tolist()
    full = f.L[perm].tolist()
    b = f.batch[perm].tolist()
    C = f.C
    out = np.empty(f.n, dtype=np.int64)
    pack = -1
    load = 0
    prev_b = -1
    lab = [0] * len(add)
    for k in range(len(add)):
        if b[k] != prev_b or load + add[k] > C:
            pack += 1
            load = full[k]
            prev_b = b[k]
        else:
            load += add[k]
        lab[k] = pack
    out[perm] = lab
    return out


def contiguous_cut(f: Forest, perm: np.ndarray) -> np.ndarray:
    """The optimal cut of an order into contiguous packs: min sum of lcp at pack starts.

    f[b] = min over a of f[a-1] + lcp_a, over a with lcp_a + sum_{k=a..b} add_k <= C, i.e. with
    g(a) = D(a) - L_a >= D(b) - C (D = prefix sums of add = L - lcp). D(b) grows with b, so a start that
    becomes infeasible stays so: a min-heap with lazy deletion gives O(n log n). Heap keys are single ints
    ``cost * M + a`` (ties go to the earlier start, which tends to need fewer packs).
    """
    C = f.C
    lcp = f.order_lcp(perm)
    L = f.L[perm]
    D = np.cumsum(L - lcp)
    g = (D - L).tolist()
    Dl = D.tolist()
    lcpl = lcp.tolist()
    n = len(perm)
    M = n + 1
    choice = [0] * n
    push, pop = heapq.heappush, heapq.heappop
    batch_of = f.batch[perm]
    bounds = np.flatnonzero(np.r_[True, batch_of[1:] != batch_of[:-1], True]).tolist() if n else [0]
    for lo, hi in itertools.pairwise(bounds):  # packs never cross a batch
        heap: list[int] = []
        cost_prev = 0  # best cost of the sequences before k
        for k in range(lo, hi):
            push(heap, (cost_prev + lcpl[k]) * M + k)
            lim = Dl[k] - C
            top = heap[0]
            while g[top % M] < lim:
                pop(heap)
                top = heap[0]
            cost_prev = top // M
            choice[k] = top % M
    lab_sorted = np.empty(n, dtype=np.int64)
    k = n - 1
    groups = []
    while k >= 0:
        a = choice[k]
        groups.append((a, k + 1))
        k = a - 1
    groups.reverse()
    for p, (a, e) in enumerate(groups):
        lab_sorted[a:e] = p
    out = np.empty(n, dtype=np.int64)
    out[perm] = lab_sorted
    return out


# --------------------------------------------------------------------------------------------------
# bottom-up best-fit decreasing (non-contiguous packs), and the child order it induces


def bottom_up_labels(f: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Bin packing at every node, leaves to roots: (labels, a child-order key for ``dfs_order``).

    At node v the packs ("bins") of its children are items; best-fit decreasing groups them into as few
    bins as fit ``C - depth(v) - len(v)``, and each bin then holds v's tokens once. Pieces of two subtrees
    may so share two packs, which no contiguous cut of a DFS order can express. The key lists each
    node's children in the order of the bins they joined (bins by creation, largest items first).
    """
    t = f.t
    C = f.C
    V = t.n_nodes
    parent = t.node_parent.tolist()
    wlen = t.node_len.tolist()
    end_depth = f.end_depth.tolist()
    node_batch = f.node_batch().tolist()
    n_kids = t.node_children.tolist()
    en = f.end_node
    ends_first = np.searchsorted(en, np.arange(V), side="left").tolist()
    ends_last = np.searchsorted(en, np.arange(V), side="right").tolist()
    pending: list[list | None] = [None] * V  # (load, bin id, child node) of the children's bins
    n_batches = len(f.batch_bounds) - 1
    root_pending: list[list] = [[] for _ in range(n_batches)]
    bin_parent: list[int] = []
    seq_bin = np.empty(f.n, dtype=np.int64)
    key = [0] * V
    bisect_left, insort = bisect.bisect_left, bisect.insort

    def best_fit(items: list, inner: int) -> list[list]:
        """items: (load, bin id, node); returns bins [sum, [bin ids]] (largest items first)."""
        items.sort(key=lambda it: -it[0])
        bins: list[list] = []
        residual: list[tuple[int, int]] = []  # sorted (residual, bin index)
        for load, bid, node in items:
            j = bisect_left(residual, (load, -1))
            if j < len(residual):
                r, k = residual.pop(j)
                bins[k][0] += load
                bins[k][1].append(bid)
                insort(residual, (r - load, k))
            else:
                k = len(bins)
                bins.append([load, [bid]])
                insort(residual, (inner - load, k))
            if node >= 0 and (key[node] == 0 or k + 1 < key[node]):
                key[node] = k + 1
        return bins

    for v in range(V - 1, -1, -1):
        items = pending[v]
        w = wlen[v]
        if items is None:  # a leaf: one new bin
            bid = len(bin_parent)
            bin_parent.append(-1)
            out = [(w, bid, v)]
        elif n_kids[v] == 1:  # one child: its bins did not fit together there, nor will they here
            out = [(load + w, bid, v) for load, bid, _ in items]
            key[items[0][2]] = 1
        else:
            out = []
            for load, members in best_fit(items, C - end_depth[v]):
                bid = len(bin_parent)
                bin_parent.append(-1)
                for m in members:
                    bin_parent[m] = bid
                out.append((load + w, bid, v))
        a, e = ends_first[v], ends_last[v]
        if e > a:
            seq_bin[a:e] = out[0][1]
        p = parent[v]
        if p < 0:
            root_pending[node_batch[v]].extend(out)
        elif pending[p] is None:
            pending[p] = out
        else:
            pending[p].extend(out)
        pending[v] = None
    for b in range(n_batches):
        for load, members in best_fit(root_pending[b], C):
            bid = len(bin_parent)
            bin_parent.append(-1)
            for m in members:
                bin_parent[m] = bid
    top = np.empty(len(bin_parent), dtype=np.int64)
    bp = bin_parent
    for b in range(len(bp) - 1, -1, -1):
        top[b] = b if bp[b] < 0 else top[bp[b]]
    labels = renumber(f, top[seq_bin])
    return labels, np.asarray(key, dtype=np.int64)


def renumber(f: Forest, labels: np.ndarray) -> np.ndarray:
    """Pack ids 0..P-1 by first appearance in rank order (batches stay in order)."""
    _, first, inv = np.unique(labels, return_index=True, return_inverse=True)
    rank_of = np.empty(len(first), dtype=np.int64)
    rank_of[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank_of[inv.reshape(-1)]
