"""The DFS mode's schedule (numpy only, no model): which segments of a pack are forwarded, with or
without grad, in which order, so that memory follows the longest path and no shared prefix is
back-propagated twice. `treepack.train.modes.dfs` runs it against the model.

The algorithm (AReaL-DTA §3, Algorithms 1-3). Leaves (tokens without children) are visited in the order
of Algorithm 1 (`leaf_order`). For leaf i with longest common prefixes ``lp`` / ``ln`` (in tokens) with the
previous / next leaf and depth ``n``, `plan` emits:

1. *push* the shared part [lp, ln) that the next leaves read: an **anchor** (no-grad forward over the
   cached path; its K/V go to the path cache ``kv[layer, depth]``), or, within ``keep_tokens``, **keep**
   steps (forward with grad whose graph stays alive until popped);
2. *pop* [ln, n), which no later leaf passes through, right to left in calls of at most ``block_size``
   tokens (Algorithm 3's Pop_ByChunk): each **grad** step forwards its chain with grad over the cached
   rows [0, lo), attaches its loss terms, and back-propagates at once; a kept piece is **released**
   (its stored graph back-propagated). The topmost call takes as many of the leaf's fresh tokens as the
   block allows, and the fresh tokens below it are anchored in step 1 (one no-grad call per leaf at most).

Subtrees that fit one block are not walked at all (``subtree_calls``, on by default): each is forwarded
and back-propagated in one call with its tree mask over the cached path (sibling subtrees together while
they fit, with the path tokens above them when those fit too), so ``dfs`` costs what ``tree`` does
wherever the tree fits one block and walks leaf by leaf only where it is larger. Each model call costs
host time (tens of ms for a 28-layer model), so fewer, larger calls are faster at the same FLOPs.

Every real token is forwarded with grad exactly once (in the pop that finishes its subtree), so the work
is N_tree tokens forward and backward plus the anchors, and no graph is ever re-entered. Anchors are the
overhead: walking leaf by leaf with ``keep_tokens = 0`` they are the tokens of shared nodes plus each
leaf's own tail beyond one block, independent of the leaf order; the order (Algorithm 1: internal
children first, longest tail first) only merges anchors and pops into fewer calls. Two merges cut calls
further: a small anchor that follows a grad call at its own depth rides along in that call
(``merge_anchor_tokens``, `_merge_anchor`; its backward of zero gradients in exchange), and a pop of the
path rows just above the previous call's tokens joins that call (``merge_pops``, `_merge_pops`; the same
tokens and pairs), so a path ending in many small branch points is popped in as few calls as the block
allows. Anchor share (anchor / all forwarded tokens) and model calls of `benchmarks/dfs.py`'s workloads
(``--plan-only``; calls without either merge in brackets; results/2026-11-26-dfs-merge-plan.md):

    workload (N_tree, leaves, longest path)          B=2048         B=8192          B=2048 keep=8192
    tau-bench retail, 144 records (58k, 10, 9.4k)    41%, 42        2.1%, 10 (11)   40%, 47
    synth tau2, 2 tasks (79k, 16, 8.6k)              37%, 62        1.6%, 14 (15)   36%, 64
    synth tau2 --think, 1 task (46k, 48, 7.4k)       24%, 35 (51)   8.7%, 10 (23)   0.5%, 86

Chains with long private tails (tau-bench: one trajectory per task) pay for a small block; combs of short
leaves on a long shared trunk (dropped reasoning) pay for anchoring the trunk unless it is kept.

Legend: T pack tokens, C tokens of a step, N radix nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from treepack.train.config import DFS_ORDERS, DfsConfig

ORDERS = DFS_ORDERS


# --------------------------------------------------------------------------------------------------
# The schedule (numpy only): which segments are forwarded, with or without grad, in which order


@dataclass(frozen=True)
class Step:
    """One model call of the traversal over a chain of tokens at depths [lo, hi) of the current path."""

    kind: str  # anchor | keep | grad | release (see STEP_KINDS)
    lo: int  # depth of the first token: the segment attends to the cached path rows [0, lo)
    tokens_C: np.ndarray  # int64 pack indices of the segment's tokens, root to leaf
    kv_grad: bool  # grad/release: rows of the segment were cached, so later segments sent them dK/dV
    subtree_end_C: np.ndarray | None = None  # a tree call: its local subtree ends (None: a chain)
    n_path: int | None = None  # tree call: its first n_path tokens are path rows [lo, lo + n_path), the rest
    # whole subtrees below them (None: all tokens are path rows)
    n_anchor: int = 0  # grad call: its last n_anchor tokens are an anchor riding along (`_merge_anchor`): a chain
    # at depths [lo, lo + n_anchor) of the next path, no loss, its K/V cached once the call's forward has run

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"step kind must be one of {', '.join(STEP_KINDS)}, got {self.kind!r}")

    @property
    def hi(self) -> int:
        return self.lo + int(self.tokens_C.shape[0])

    @property
    def n(self) -> int:
        return int(self.tokens_C.shape[0])

    @property
    def is_tree(self) -> bool:
        return self.subtree_end_C is not None

    @property
    def path_rows(self) -> int:
        """Tokens of the step that are rows of the current path (the ones a K/V cache row may hold)."""
        return self.n if self.n_path is None else self.n_path

    @property
    def local_ends(self) -> np.ndarray:
        """Each token's subtree end within the call (a chain's: the call's end)."""
        return self.subtree_end_C if self.is_tree else np.full(self.n, self.n, dtype=np.int64)

    @property
    def n_own(self) -> int:
        """Tokens the step forwards for itself (all but a merged anchor's)."""
        return self.n - self.n_anchor


STEP_KINDS = {
    "anchor": "no-grad forward; caches the segment's K/V for the segments below it (AReaL-DTA's FWD-NoGrad)",
    "keep": "forward with grad; caches K/V, attaches the segment's loss, keeps its graph until its release",
    "grad": "forward with grad, attach loss, backward at once (with the dK/dV its rows received when cached)",
    "release": "backward of a kept segment's graph with the dK/dV its rows received",
}


@dataclass
class Schedule:
    """The whole traversal of one pack, and its work and memory in tokens."""

    steps: list[Step]
    n_tokens: int  # tokens traversed (each is forwarded with grad exactly once)
    n_pruned: int  # tokens left out: no loss term reads their hidden state or that of a descendant
    max_depth: int  # longest root-to-leaf path = rows of the K/V cache
    n_leaves: int  # tokens without children (the traversal visits one path per leaf)
    block_size: int | None  # most tokens forwarded with grad in one call (None: unlimited)
    keep_tokens: int  # most tokens of kept graphs alive at once (0: every shared segment is anchored)
    order: str  # leaf order: backward (AReaL-DTA Algorithm 1) | layout (the pack's preorder)
    peak_graph_tokens: int  # most tokens whose graph is alive at once (kept + the current call)

    def tokens_of(self, *kinds: str) -> int:
        """Tokens the steps of these kinds forward for themselves (merged anchors not included)."""
        return sum(s.n_own for s in self.steps if s.kind in kinds)

    def count(self, *kinds: str) -> int:
        return sum(1 for s in self.steps if s.kind in kinds)

    @property
    def grad_tokens(self) -> int:
        """Tokens forwarded with grad and a loss (= n_tokens: each exactly once)."""
        return self.tokens_of("grad", "keep")

    @property
    def anchor_tokens(self) -> int:
        """Tokens forwarded for their K/V only, in anchor calls or merged into grad calls: the re-forward
        overhead."""
        return self.tokens_of("anchor") + self.merged_anchor_tokens

    @property
    def merged_anchor_tokens(self) -> int:
        return sum(s.n_anchor for s in self.steps)


@dataclass
class _Nodes:
    """Radix nodes of a pack: maximal chains whose inner tokens have exactly one child."""

    start_N: np.ndarray  # int64 first token
    end_N: np.ndarray  # int64 exclusive end (node tokens are the contiguous range [start, end))
    parent_N: np.ndarray  # int64 parent node (-1 at a root)
    depth_N: np.ndarray  # int64 depth of the first token
    children: list[list[int]]
    roots: list[int]

    @property
    def depth_end_N(self) -> np.ndarray:
        return self.depth_N + (self.end_N - self.start_N)


def tree_nodes(parent_T: np.ndarray) -> _Nodes:
    """Split tokens (``parent[t] < t``) into radix nodes. A node starts at a root, at a token whose parent is
    not the previous token, or at a child of a branch point; it is therefore a contiguous chain."""
    parent_T = np.asarray(parent_T, dtype=np.int64)
    T = parent_T.shape[0]
    index_T = np.arange(T, dtype=np.int64)
    has_parent_T = parent_T >= 0
    if np.any(parent_T >= index_T):
        t = int(np.argmax(parent_T >= index_T))
        raise ValueError(f"parent must precede each token (DFS preorder); parent[{t}] = {int(parent_T[t])}")
    n_children_T = np.bincount(parent_T[has_parent_T], minlength=T)
    is_start_T = ~has_parent_T | (parent_T != index_T - 1)
    is_start_T[has_parent_T] |= n_children_T[parent_T[has_parent_T]] >= 2
    start_N = np.flatnonzero(is_start_T).astype(np.int64)
    end_N = np.append(start_N[1:], T).astype(np.int64)[: start_N.shape[0]]  # no tokens: no nodes (nothing to end)
    parent_tok_N = parent_T[start_N]
    parent_N = np.where(parent_tok_N >= 0, np.searchsorted(start_N, parent_tok_N, side="right") - 1, -1)
    N = start_N.shape[0]
    depth_N = np.zeros(N, dtype=np.int64)
    length = (end_N - start_N).tolist()
    par, depth = parent_N.tolist(), [0] * N
    children: list[list[int]] = [[] for _ in range(N)]
    roots: list[int] = []
    for n in range(N):  # parents precede children
        p = par[n]
        if p < 0:
            roots.append(n)
        else:
            depth[n] = depth[p] + length[p]
            children[p].append(n)
    depth_N[:] = depth
    return _Nodes(start_N, end_N, parent_N, depth_N, children, roots)


def leaf_order(nodes: _Nodes, order: str = "backward") -> list[int]:
    """Leaf nodes in traversal order.

    ``layout``: the pack's DFS preorder. ``backward``: AReaL-DTA's Algorithm 1 — in postorder, sort each
    node's children by (is internal, tail) ascending, where tail(leaf) = its depth and tail(v) = tail of v's
    first child; the order is the reverse of the DFS leaf sequence under that child order. Reversing a DFS
    leaf sequence equals a DFS whose every child list (the roots' included) is reversed, which is how it is
    computed here: internal children first, longer tails first, leaf-only branches last.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    children = [list(c) for c in nodes.children]
    roots = list(nodes.roots)
    if order == "backward":
        tail = nodes.depth_end_N.tolist()

        def key(c: int) -> tuple[bool, int]:
            return bool(children[c]), tail[c]

        for n in range(len(children) - 1, -1, -1):  # children have larger indices: reverse index = postorder
            if children[n]:
                children[n].sort(key=key)
                tail[n] = tail[children[n][0]]
                children[n].reverse()
        roots.sort(key=key)
        roots.reverse()
    leaves: list[int] = []
    stack = roots[::-1]
    while stack:
        n = stack.pop()
        if children[n]:
            stack.extend(reversed(children[n]))
        else:
            leaves.append(n)
    return leaves


# A no-grad model call costs host time whatever its size: ~600 launches for a 28-layer model, ~30 ms where
# the host sets the pace (dfs on an H200: ~97 ms per fwd+bwd call, the host queueing 97% of the step). Riding
# along in a grad call instead costs the anchor's backward (zero gradients, but the same FLOPs): ~11 us a token
# for Qwen3-0.6B on an H200, so ~2,800 tokens break even when host-bound and ~250 when GPU-bound. The default,
# 512, is [train.dfs] merge_anchor_tokens' (treepack.train.config.DfsConfig).
MERGE_ANCHOR_TOKENS = DfsConfig.merge_anchor_tokens


def _merge_anchor(prev: Step, anchor: Step, limit: int, most: int) -> Step | None:
    """``prev`` with ``anchor``'s tokens appended as a separate chain, or None where that is not exact or not
    worth it. Exact when ``prev`` is a grad call at the anchor's depth: it reads the same cached rows
    [0, lo) the anchor would (nothing writes the cache between the two), its mask keeps the two apart (no
    token of ``prev`` lies below the anchor's, nor the reverse), no loss row reads the anchor's hidden
    states (they are attached to the later call that forwards those tokens with grad), so their gradient
    is exactly zero, and their K/V are cached detached, as an anchor's are."""
    if (prev.kind != "grad" or prev.n_anchor or prev.lo != anchor.lo or anchor.n > most
            or prev.n + anchor.n > limit):
        return None
    n = prev.n + anchor.n
    return Step("grad", prev.lo, np.concatenate([prev.tokens_C, anchor.tokens_C]), kv_grad=prev.kv_grad,
                subtree_end_C=np.concatenate([prev.local_ends, np.full(anchor.n, n, dtype=np.int64)]),
                n_path=prev.path_rows, n_anchor=anchor.n)


def _merge_pops(prev: Step, new: Step, parent_T: np.ndarray, limit: int) -> Step | None:
    """One call for two consecutive pops of one path, or None. ``new`` pops the path rows just above ``prev``'s
    tokens (its last path row is the parent of ``prev``'s first token), so ``prev``'s tokens hang below that
    row as ``new``'s own subtrees do. Order: ``new``'s path rows, ``prev``'s tokens, ``new``'s subtrees: a
    preorder, each token's descendants right after it. Every token reads the same rows, in the call instead
    of from the cache: the same tokens and attention pairs in one call fewer."""
    if (prev.kind != "grad" or new.kind != "grad" or prev.n_anchor or new.n_anchor or new.path_rows == 0
            or new.lo + new.path_rows != prev.lo or prev.n + new.n > limit
            or parent_T[prev.tokens_C[0]] != new.tokens_C[new.path_rows - 1]):
        return None
    p, ends_prev, ends_new = new.path_rows, prev.local_ends, new.local_ends
    return Step("grad", new.lo, np.concatenate([new.tokens_C[:p], prev.tokens_C, new.tokens_C[p:]]),
                kv_grad=prev.kv_grad or new.kv_grad,
                subtree_end_C=np.concatenate([ends_new[:p] + prev.n, ends_prev + p, ends_new[p:] + prev.n]),
                n_path=p + prev.path_rows)


def _chunks_right_to_left(lo: int, hi: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into ceil(len / block) near-equal pieces, rightmost first."""
    if hi <= lo:
        return []
    m = -(-(hi - lo) // block)
    bounds = [lo + (k * (hi - lo)) // m for k in range(m + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(m - 1, -1, -1)]


def _node_pieces(path: list[int], depth: list[int], depth_end: list[int], lo: int, hi: int,
                 block: int) -> list[tuple[int, int]]:
    """[lo, hi) of a path cut at radix-node boundaries (where later pop ranges may start) and into
    pieces of at most ``block`` tokens, left to right."""
    out = []
    for n in path:
        a, b = max(lo, depth[n]), min(hi, depth_end[n])
        while a < b:
            out.append((a, min(b, a + block)))
            a = out[-1][1]
    return out


def subtree_ends(nodes: _Nodes) -> np.ndarray:
    """int64 [T]: exclusive end of each token's subtree (tokens in DFS preorder). A token's subtree is the
    rest of its radix node and the node's descendants, so one reverse pass over nodes, not tokens."""
    end = nodes.end_N.tolist()
    parent = nodes.parent_N.tolist()
    for v in range(len(end) - 1, -1, -1):  # children have larger indices: each is final before its parent
        p = parent[v]
        if p >= 0 and end[v] > end[p]:
            end[p] = end[v]
    return np.repeat(np.asarray(end, dtype=np.int64), nodes.end_N - nodes.start_N)


def live_tokens(parent_T: np.ndarray, needed_T: np.ndarray) -> np.ndarray:
    """bool [T]: tokens whose subtree holds a needed token (the others change no loss and no gradient)."""
    nodes = tree_nodes(parent_T)
    T, N = int(parent_T.shape[0]), int(nodes.start_N.shape[0])
    needed_idx = np.flatnonzero(needed_T)
    last_N = np.full(N, -1, dtype=np.int64)
    np.maximum.at(last_N, np.searchsorted(nodes.start_N, needed_idx, side="right") - 1, needed_idx)
    live_end_N = np.where(last_N >= 0, last_N + 1, nodes.start_N)
    start, end, parent_N = nodes.start_N.tolist(), nodes.end_N.tolist(), nodes.parent_N.tolist()
    live_end = live_end_N.tolist()
    child_live = [False] * N
    for n in range(N - 1, -1, -1):  # children first
        if child_live[n]:
            live_end[n] = end[n]
        if live_end[n] > start[n] and parent_N[n] >= 0:
            child_live[parent_N[n]] = True
    delta = np.zeros(T + 1, dtype=np.int64)
    np.add.at(delta, nodes.start_N, 1)
    np.add.at(delta, np.asarray(live_end, dtype=np.int64), -1)
    return np.cumsum(delta[:T]) > 0


def plan(parent_T: np.ndarray, *, needed_T: np.ndarray | None = None, block_size: int | None = 2048,
         keep_tokens: int = 0, order: str = "backward", subtree_calls: bool = True,
         merge_anchor_tokens: int = MERGE_ANCHOR_TOKENS, merge_pops: bool = True) -> Schedule:
    """The traversal of the tokens with parents ``parent_T`` (see `_plan`); with ``needed_T`` (bool [T]:
    tokens whose hidden state a loss term reads) only over the `live_tokens`, e.g. never a leaf's last token."""
    parent_T = np.asarray(parent_T, dtype=np.int64)
    options = {"block_size": block_size, "keep_tokens": keep_tokens, "order": order,
               "subtree_calls": subtree_calls, "merge_anchor_tokens": merge_anchor_tokens, "merge_pops": merge_pops}
    if needed_T is None:
        return _plan(parent_T, **options)
    live_T = live_tokens(parent_T, np.asarray(needed_T, dtype=bool))
    index_L = np.flatnonzero(live_T)
    compact_T = np.cumsum(live_T) - 1
    parent_L = parent_T[index_L]
    parent_L = np.where(parent_L >= 0, compact_T[np.maximum(parent_L, 0)], -1)  # a live token's parent is live
    sched = _plan(parent_L, **options)
    sched.steps = [dataclasses.replace(st, tokens_C=index_L[st.tokens_C]) for st in sched.steps]
    sched.n_pruned = int(parent_T.shape[0] - index_L.shape[0])
    return sched


def _plan(parent_T: np.ndarray, *, block_size: int | None, keep_tokens: int, order: str,
          subtree_calls: bool = True, merge_anchor_tokens: int = MERGE_ANCHOR_TOKENS,
          merge_pops: bool = True) -> Schedule:
    """The traversal of a pack whose real tokens have parents ``parent_T`` (see the module doc).

    Per leaf of the order, with ``lp`` / ``ln`` its longest common prefix (tokens) with the previous / next
    leaf and ``n`` its depth:

    1. push the shared part [lp, ln) that the next leaves read: whole-node pieces of at most
       ``block_size`` tokens are *kept* (forward with grad, graph alive) while the kept tokens stay within
       ``keep_tokens``; the rest is *anchored* (no-grad forward, K/V cached);
    2. the *pop range* [ln, n) is finished (no later leaf passes there). Right to left: kept pieces are
       *released* (backward of their graph); everything else is forwarded with grad and back-propagated
       in calls of at most ``block_size`` tokens. The topmost call [s, n) is as large as the block allows,
       so that the fewest of the leaf's fresh tokens need an anchor; tokens [lp, s) not kept are anchored
       in step 1 (one no-grad call per leaf at most).

    ``subtree_calls`` (default): a subtree of at most ``block_size`` tokens whose parent's subtree is larger
    is not walked but popped whole in one call with its tree mask (after its path is anchored), and
    consecutive such siblings share a call while they fit together: a GRPO group's samples, or the last
    turns of a conversation, cost one call instead of one per leaf. The whole pack is one call if it
    fits. Off: AReaL-DTA's walk, leaf by leaf.

    An anchor of at most ``merge_anchor_tokens`` tokens rides along in the grad call just before it when
    that call starts at the same depth and both fit one block (`_merge_anchor`): one model call fewer.
    With ``merge_pops`` (and subtree calls), a pop of the path rows just above the previous call's tokens
    joins that call when both fit one block (`_merge_pops`): the path is popped upward in as few calls as
    the block allows instead of one call per radix node.
    """
    parent_T = np.asarray(parent_T, dtype=np.int64)
    block = int(block_size) if block_size else 0
    if block < 0 or keep_tokens < 0:
        raise ValueError(f"block_size and keep_tokens must be >= 0, got {block_size} and {keep_tokens}")
    limit = block or max(int(parent_T.shape[0]), 1)
    nodes = tree_nodes(parent_T)
    n_leaves = sum(1 for c in nodes.children if not c)
    T = int(parent_T.shape[0])
    end_T = subtree_ends(nodes)
    if subtree_calls and 0 < T <= limit:  # the whole tree fits one call: forward it as a tree, no walk
        step = Step("grad", 0, np.arange(T, dtype=np.int64), kv_grad=False, subtree_end_C=end_T, n_path=0)
        return Schedule(steps=[step], n_tokens=T, n_pruned=0, max_depth=int(nodes.depth_end_N.max()),
                        n_leaves=n_leaves, block_size=block or None, keep_tokens=int(keep_tokens), order=order,
                        peak_graph_tokens=T)
    start, depth, depth_end = nodes.start_N.tolist(), nodes.depth_N.tolist(), nodes.depth_end_N.tolist()
    parent_N = nodes.parent_N.tolist()
    # Subtrees that fit one call (the largest such under a parent that does not) are popped whole, with
    # their tree mask, instead of leaf by leaf: their nodes are not walked (contracted into one "leaf").
    size = (end_T[nodes.start_N] - nodes.start_N).tolist()  # tokens of each node's subtree
    blob = [subtree_calls and size[v] <= limit and (parent_N[v] < 0 or size[parent_N[v]] > limit)
            for v in range(len(size))]
    contracted = dataclasses.replace(nodes, children=[[] if blob[v] else c for v, c in enumerate(nodes.children)])
    leaves = leaf_order(contracted, order)

    def path_of(leaf: int) -> list[int]:
        path = []
        while leaf >= 0:
            path.append(leaf)
            leaf = parent_N[leaf]
        return path[::-1]

    def lcp(a: list[int], b: list[int]) -> int:
        k = 0
        for x, y in zip(a, b):
            if x != y:
                break
            k += 1
        return depth_end[a[k - 1]] if k else 0

    def tokens(path: list[int], lo: int, hi: int) -> np.ndarray:
        parts = []
        for n in path:
            a, b = max(lo, depth[n]), min(hi, depth_end[n])
            if a < b:
                parts.append(np.arange(start[n] + a - depth[n], start[n] + b - depth[n], dtype=np.int64))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    # Items of the walk: a leaf (its path), or consecutive sibling subtrees that fit one call together
    # (the path above them; they read its rows and nobody reads theirs).
    paths: list[list[int]] = []
    groups: list[list[int]] = []  # per item: the subtrees it pops whole ([] for a leaf)
    for leaf in leaves:
        if blob[leaf] and groups and groups[-1] and parent_N[groups[-1][-1]] == parent_N[leaf] \
                and sum(size[v] for v in groups[-1]) + size[leaf] <= limit:
            groups[-1].append(leaf)
        else:
            paths.append(path_of(leaf)[:-1] if blob[leaf] else path_of(leaf))
            groups.append([leaf] if blob[leaf] else [])

    steps: list[Step] = []
    kept: list[tuple[int, int]] = []  # kept pieces on the stack, ascending
    kept_alive = peak = 0

    def add_grad(step: Step) -> None:
        """Append a grad step, as one call with the step before it where `_merge_pops` allows."""
        nonlocal peak
        merged = _merge_pops(steps[-1], step, parent_T, limit) if merge_pops and subtree_calls and steps else None
        if merged is None:
            steps.append(step)
        else:
            steps[-1] = step = merged
        peak = max(peak, kept_alive + step.n)

    for i, path in enumerate(paths):
        n = depth_end[path[-1]] if path else 0
        lp = lcp(paths[i - 1], path) if i > 0 else 0
        ln = lcp(path, paths[i + 1]) if i + 1 < len(paths) else 0
        anchored_from = lp
        if ln > lp and keep_tokens:
            for a, b in _node_pieces(path, depth, depth_end, lp, ln, limit):
                if kept_alive + b - a > keep_tokens:
                    break
                steps.append(Step("keep", a, tokens(path, a, b), kv_grad=False))
                kept.append((a, b))
                kept_alive += b - a
                peak = max(peak, kept_alive)
                anchored_from = b
        releases = [(a, b) for a, b in kept if a >= ln]
        top = releases[-1][1] if releases else ln
        fresh = max(lp, ln)  # [fresh, n): the leaf's own tokens, never forwarded yet
        pop = n - top
        total = sum(size[v] for v in groups[i])
        if groups[i]:  # whole subtrees below the path, with the path's pop range if it fits, else its fresh part
            room = limit - total
            s = n - min(room, pop if pop <= room else n - fresh)
        else:
            s = n - min(limit, max(n - fresh, -(-pop // -(-pop // limit))))
        if s > anchored_from:
            anchor = Step("anchor", anchored_from, tokens(path, anchored_from, s), kv_grad=False)
            merged = _merge_anchor(steps[-1], anchor, limit, merge_anchor_tokens) if steps else None
            if merged is None:
                steps.append(anchor)
            else:
                steps[-1] = merged
                peak = max(peak, kept_alive + merged.n)
        cached = max(lp, s)  # rows [0, cached) hold K/V now (s >= ln when ln > lp)
        if groups[i]:  # one call: path tokens [s, n) (every later token of the call is below them), subtrees
            ranges = [(start[v], start[v] + size[v]) for v in groups[i]]
            offsets = (n - s + np.cumsum([0] + [b - a for a, b in ranges])).tolist()
            tok = np.concatenate([tokens(path, s, n)] + [np.arange(a, b, dtype=np.int64) for a, b in ranges])
            ends = np.concatenate([np.full(n - s, offsets[-1], dtype=np.int64)]
                                  + [end_T[a:b] - a + o for (a, b), o in zip(ranges, offsets[:-1])])
            add_grad(Step("grad", s, tok, kv_grad=s < cached, subtree_end_C=ends, n_path=n - s))
            calls = _chunks_right_to_left(top, s, limit)
        else:
            calls = [(s, n)] + _chunks_right_to_left(top, s, limit)
        for a, b in calls:
            add_grad(Step("grad", a, tokens(path, a, b), kv_grad=a < cached))
        below = top
        for a, b in reversed(releases):
            for x, y in _chunks_right_to_left(b, below, limit):
                add_grad(Step("grad", x, tokens(path, x, y), kv_grad=True))
            steps.append(Step("release", a, tokens(path, a, b), kv_grad=True))
            kept_alive -= b - a
            below = a
        for x, y in _chunks_right_to_left(ln, below, limit):
            add_grad(Step("grad", x, tokens(path, x, y), kv_grad=True))
        kept = [(a, b) for a, b in kept if a < ln]
    return Schedule(steps=steps, n_tokens=int(parent_T.shape[0]), n_pruned=0, max_depth=max(depth_end, default=0),
                    n_leaves=n_leaves, block_size=block or None, keep_tokens=int(keep_tokens), order=order,
                    peak_graph_tokens=peak)
