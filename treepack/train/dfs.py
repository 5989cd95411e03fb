"""DFS mode: AReaL-DTA's dynamic tree attention. Walk a pack's prefix tree depth first, keep only the
current path's keys/values, and bound the live autograd graph by ``block_size`` tokens.

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

Subtrees that fit one block are not walked at all (`_plan`'s ``subtree_calls``): each is forwarded and
back-propagated in one call with its tree mask over the cached path (sibling subtrees together while they
fit), so ``dfs`` costs what ``tree`` does wherever the tree fits one block, and walks leaf by leaf only
where the tree is larger than a block. Each model call costs host time (tens of ms for a 28-layer model),
so fewer, larger calls are faster at the same FLOPs.

Every real token is forwarded with grad exactly once (in the pop that finishes its subtree), so the work
is N_tree tokens forward and backward plus the anchors, and no graph is ever re-entered.

Exactness. The loss is a sum of terms: row (s, j) predicts ``path_s[j]`` from the hidden state of
``h = parent[path_s[j]]``, with weights fixed for the global batch before any forward. Each term is
attached to the one step that forwards ``h`` with grad: branch points' several targets, duplicates and
prefix-of-another sequences need no special case. A step sees exactly the keys/values a full forward
would give it (its chain causally, its ancestors through the cache), so its hidden states and loss are
exact. For gradients: a cached row's K/V are read by later steps as leaf tensors; their gradients are
summed into ``grad[layer, depth]`` (float32 for 16-bit models) and handed to the row's own K/V outputs
when the row is popped, as ``torch.autograd.backward([loss, K_l, V_l], [1, dK_l, dV_l])``. Every reader
of a row lies in its subtree and the traversal pops a row only when its subtree is done (deepest first),
so all of dK/dV has arrived by then: by the chain rule, each parameter receives exactly the dense
gradient, summed in another order (float64: ~1e-15 relative). Tokens whose subtree holds no loss term
(always a leaf's last token) are pruned first; they change nothing.

Memory. The path cache holds the longest path's K/V and their gradients: per token
``layers x 2 x kv_heads x head_dim`` values, in the model dtype plus float32 for the gradient (Qwen3-0.6B
in bf16: 112 KiB + 224 KiB per path token, 3.0 GiB for tau-bench's 9.4k-token path). The graph alive at
once is one call's (``block_size`` tokens) plus the kept pieces (``keep_tokens``); it does not grow with
the tree. Work. Anchors are the overhead: with ``keep_tokens = 0`` they are the tokens of shared nodes
plus each leaf's own tail beyond one block, independent of the leaf order; the order (Algorithm 1:
internal children first, longest tail first) only merges anchors and pops into fewer calls. Anchor
share (anchor / all forwarded tokens) of `benchmarks/dfs.py`'s workloads (``--plan-only``):

    workload (N_tree, leaves, longest path)          B=2048   B=8192   B=2048 keep=8192
    tau-bench retail, 144 records (58k, 10, 9.4k)       41%      2.5%     40%
    synth tau2, 2 tasks (79k, 16, 8.6k)                 37%      1.6%     36%
    synth tau2 --think, 1 task (46k, 48, 7.4k)          25%      25%      0.5%

Chains with long private tails (tau-bench: one trajectory per task) pay for a small block; combs of short
leaves on a long shared trunk (dropped reasoning) pay for anchoring the trunk unless it is kept. Each step
is a full model call, so its host-side cost matters too: ~40-60 ms per call of kernel launches for
Qwen3-0.6B (28 layers, compiled elementwise regions), which a call of a few thousand tokens does not
hide. On an H200 a tau-bench step took 1.33 s at B=8192 (11 calls) against 1.21 s for tree mode in 3
packs, at 17 GiB instead of 43 GiB; subtree calls took synthetic tau2 (2 tasks) from 18 calls / 2.47 s
to 15 / 1.62 s.
Prefer the largest block the memory allows (benchmarks/results/2026-11-21-dfs.md).

Legend: T pack tokens, C tokens of a step, X targets of a step, U target tokens of the pack, R loss
rows, L layers, P cached path rows, K kv heads, E head dim, D hidden size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from treepack.errors import ConfigError
from treepack.layout import Pack
from treepack.train.losses import BatchTotals, LossRows, Objective, target_logprobs, token_weights_fast
from treepack.train.model import KV, AttentionContext, Decoder
from treepack.train.modes import LayoutError, Mode, ModeResult, _row_dtype

ORDERS = ("backward", "layout")


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
        return sum(s.n for s in self.steps if s.kind in kinds)

    def count(self, *kinds: str) -> int:
        return sum(1 for s in self.steps if s.kind in kinds)

    @property
    def grad_tokens(self) -> int:
        """Tokens forwarded with grad (= n_tokens: each exactly once)."""
        return self.tokens_of("grad", "keep")

    @property
    def anchor_tokens(self) -> int:
        """Tokens forwarded without grad: the re-forward overhead."""
        return self.tokens_of("anchor")


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
    end_N = np.append(start_N[1:], T).astype(np.int64)
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


def subtree_ends(parent_T: np.ndarray) -> np.ndarray:
    """int64 [T]: exclusive end of each token's subtree, for tokens in DFS preorder (``parent[t] < t``)."""
    parent = np.asarray(parent_T, dtype=np.int64).tolist()
    end = list(range(1, len(parent) + 1))
    for t in range(len(parent) - 1, 0, -1):  # children after parents: a reverse pass sees every child first
        p = parent[t]
        if p >= 0 and end[t] > end[p]:
            end[p] = end[t]
    return np.asarray(end, dtype=np.int64)


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
         keep_tokens: int = 0, order: str = "backward", subtree_calls: bool = True) -> Schedule:
    """The traversal of the tokens with parents ``parent_T`` (see `_plan`); with ``needed_T`` (bool [T]:
    tokens whose hidden state a loss term reads) only over the `live_tokens`, e.g. never a leaf's last token."""
    parent_T = np.asarray(parent_T, dtype=np.int64)
    if needed_T is None:
        return _plan(parent_T, block_size=block_size, keep_tokens=keep_tokens, order=order,
                     subtree_calls=subtree_calls)
    live_T = live_tokens(parent_T, np.asarray(needed_T, dtype=bool))
    index_L = np.flatnonzero(live_T)
    compact_T = np.cumsum(live_T) - 1
    parent_L = parent_T[index_L]
    parent_L = np.where(parent_L >= 0, compact_T[np.maximum(parent_L, 0)], -1)  # a live token's parent is live
    sched = _plan(parent_L, block_size=block_size, keep_tokens=keep_tokens, order=order, subtree_calls=subtree_calls)
    sched.steps = [dataclasses.replace(st, tokens_C=index_L[st.tokens_C]) for st in sched.steps]
    sched.n_pruned = int(parent_T.shape[0] - index_L.shape[0])
    return sched


def _plan(parent_T: np.ndarray, *, block_size: int | None, keep_tokens: int, order: str,
          subtree_calls: bool = True) -> Schedule:
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
    """
    parent_T = np.asarray(parent_T, dtype=np.int64)
    block = int(block_size) if block_size else 0
    if block < 0 or keep_tokens < 0:
        raise ValueError(f"block_size and keep_tokens must be >= 0, got {block_size} and {keep_tokens}")
    limit = block or max(int(parent_T.shape[0]), 1)
    nodes = tree_nodes(parent_T)
    n_leaves = sum(1 for c in nodes.children if not c)
    T = int(parent_T.shape[0])
    end_T = subtree_ends(parent_T)
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
            steps.append(Step("anchor", anchored_from, tokens(path, anchored_from, s), kv_grad=False))
        cached = max(lp, s)  # rows [0, cached) hold K/V now (s >= ln when ln > lp)
        if groups[i]:  # one call: path tokens [s, n) (every later token of the call is below them), subtrees
            ranges = [(start[v], start[v] + size[v]) for v in groups[i]]
            offsets = (n - s + np.cumsum([0] + [b - a for a, b in ranges])).tolist()
            tok = np.concatenate([tokens(path, s, n)] + [np.arange(a, b, dtype=np.int64) for a, b in ranges])
            ends = np.concatenate([np.full(n - s, offsets[-1], dtype=np.int64)]
                                  + [end_T[a:b] - a + o for (a, b), o in zip(ranges, offsets[:-1])])
            steps.append(Step("grad", s, tok, kv_grad=s < cached, subtree_end_C=ends, n_path=n - s))
            peak = max(peak, kept_alive + offsets[-1])
            calls = _chunks_right_to_left(top, s, limit)
        else:
            calls = [(s, n)] + _chunks_right_to_left(top, s, limit)
        for a, b in calls:
            steps.append(Step("grad", a, tokens(path, a, b), kv_grad=a < cached))
            peak = max(peak, kept_alive + b - a)
        below = top
        for a, b in reversed(releases):
            for x, y in _chunks_right_to_left(b, below, limit):
                steps.append(Step("grad", x, tokens(path, x, y), kv_grad=True))
                peak = max(peak, kept_alive + y - x)
            steps.append(Step("release", a, tokens(path, a, b), kv_grad=True))
            kept_alive -= b - a
            below = a
        for x, y in _chunks_right_to_left(ln, below, limit):
            steps.append(Step("grad", x, tokens(path, x, y), kv_grad=True))
            peak = max(peak, kept_alive + y - x)
        kept = [(a, b) for a, b in kept if a < ln]
    return Schedule(steps=steps, n_tokens=int(parent_T.shape[0]), n_pruned=0, max_depth=max(depth_end, default=0),
                    n_leaves=n_leaves, block_size=block or None, keep_tokens=int(keep_tokens), order=order,
                    peak_graph_tokens=peak)


# --------------------------------------------------------------------------------------------------
# Execution


class _PathCache:
    """Per-layer keys/values of the current path by depth, and the dK/dV its rows have received.

    ``kv_2LPKE`` holds K/V in the model's compute dtype; ``grad_2LPKE`` accumulates the gradients that
    later segments send to cached rows, in float32 for 16-bit K/V (one rounding per row, as a dense
    backward has, instead of one per reading segment). Segments read rows through ``.data``, an alias with
    its own autograd version counter: a kept graph saves its prefix rows [0, lo), and later writes to
    deeper rows (which it never reads) must not look like an in-place change of what it saved.
    """

    def __init__(self, n_layers: int, rows: int, k_TKE: Tensor) -> None:
        _, K, E = k_TKE.shape
        dt = k_TKE.dtype
        self.kv_2LPKE = torch.empty(2, n_layers, rows, K, E, dtype=dt, device=k_TKE.device)
        self._read = self.kv_2LPKE.data
        acc = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        self.grad_2LPKE = torch.zeros(2, n_layers, rows, K, E, dtype=acc, device=k_TKE.device)

    @property
    def nbytes(self) -> int:
        return self.kv_2LPKE.nbytes + self.grad_2LPKE.nbytes

    def write(self, lo: int, kv: list[KV]) -> None:
        with torch.no_grad():
            for layer, (k_TKE, v_TKE) in enumerate(kv):
                hi = lo + k_TKE.shape[0]
                self.kv_2LPKE[0, layer, lo:hi].copy_(k_TKE)
                self.kv_2LPKE[1, layer, lo:hi].copy_(v_TKE)

    def prefix(self, lo: int, *, grad: bool) -> list[KV] | None:
        """Rows [0, lo) per layer; with ``grad`` as leaves whose gradient is added into ``grad_2LPKE``."""
        if lo == 0:
            return None
        if not grad:
            return [(self._read[0, layer, :lo], self._read[1, layer, :lo]) for layer in range(self._read.shape[1])]
        past = []
        for layer in range(self._read.shape[1]):
            pair = []
            for j in (0, 1):
                leaf_PKE = self._read[j, layer, :lo].detach().requires_grad_()
                leaf_PKE.register_post_accumulate_grad_hook(self._accumulate(self.grad_2LPKE[j, layer, :lo]))
                pair.append(leaf_PKE)
            past.append((pair[0], pair[1]))
        return past

    @staticmethod
    def _accumulate(into_PKE: Tensor):
        def hook(leaf_PKE: Tensor) -> None:
            into_PKE.add_(leaf_PKE.grad)
            leaf_PKE.grad = None  # freed layer by layer as the backward proceeds

        return hook

    def outputs_and_grads(self, lo: int, kv: list[KV]) -> tuple[list[Tensor], list[Tensor]]:
        """The segment's own K/V (with graph) and the dK/dV its rows [lo, hi) received."""
        hi = lo + kv[0][0].shape[0]
        grad_2LCKE = self.grad_2LPKE[:, :, lo:hi].to(kv[0][0].dtype)  # one cast for every layer
        outs, grads = [], []
        for layer, (k_CKE, v_CKE) in enumerate(kv):
            outs += [k_CKE, v_CKE]
            grads += [grad_2LCKE[0, layer], grad_2LCKE[1, layer]]
        return outs, grads

    def clear(self, lo: int, hi: int) -> None:
        self.grad_2LPKE[:, :, lo:hi].zero_()


class _Targets:
    """Which log-probs the pack needs, which step computes each, and which loss rows read them (numpy).

    A target token u's log-prob is read from the hidden state of ``parent[u]``, so it belongs to the one
    with-grad step that forwards ``parent[u]``: every loss term is attached exactly once.
    """

    def __init__(self, pack: Pack, rows: LossRows, totals: BatchTotals, objective: Objective, fast: bool) -> None:
        self.weight_U: np.ndarray | None = None  # float64 fast SFT path: loss = -sum_u w_u logp_u
        if fast:
            fast_U, fast_w_U = token_weights_fast(pack, rows, totals, objective.normalization)
            token_U = np.union1d(fast_U, rows.token_R)
            self.weight_U = np.zeros(token_U.shape[0], dtype=np.float64)
            self.weight_U[np.searchsorted(token_U, fast_U)] = fast_w_U
        else:
            token_U = np.unique(rows.token_R)
        self.token_U = token_U.astype(np.int64)  # pack tokens whose log-prob is needed, sorted
        self.parent_U = np.asarray(pack.parent, dtype=np.int64)[self.token_U]
        bad = (self.parent_U < 0) | (self.parent_U >= int(pack.n_real))
        if bad.any():
            u = int(np.argmax(bad))
            raise LayoutError(f"pack token {int(self.token_U[u])} is a training target but its parent is "
                              f"{int(self.parent_U[u])}")
        self.row_u_R = np.searchsorted(self.token_U, rows.token_R).astype(np.int64)  # each row's target in U
        self.local_U = np.zeros(0, dtype=np.int64)  # index of parent[u] inside its step (after `assign`)
        self.u_of_step: dict[int, np.ndarray] = {}  # step index -> its U indices (ascending)
        self.rows_of_step: dict[int, np.ndarray] = {}  # step index -> its loss rows (ascending)


    def assign(self, schedule: Schedule, n_real: int) -> None:
        """Attach each target to the step that forwards its parent with grad."""
        step_T = np.full(n_real, -1, dtype=np.int64)
        local_T = np.zeros(n_real, dtype=np.int64)
        for k, step in enumerate(schedule.steps):
            if step.kind in ("grad", "keep"):
                step_T[step.tokens_C] = k
                local_T[step.tokens_C] = np.arange(step.n)
        step_U = step_T[self.parent_U]
        self.local_U = local_T[self.parent_U]
        self.u_of_step = _group(step_U)
        self.rows_of_step = _group(step_U[self.row_u_R])


def needed_tokens(pack: Pack, rows: LossRows) -> np.ndarray:
    """bool [n_real]: tokens whose hidden state a loss row reads (its target's parent); what `plan` keeps."""
    needed = np.zeros(int(pack.n_real), dtype=bool)
    parent_R = np.asarray(pack.parent, dtype=np.int64)[rows.token_R]
    needed[parent_R[parent_R >= 0]] = True
    return needed


def _group(key_X: np.ndarray) -> dict[int, np.ndarray]:
    """Indices of ``key_X`` grouped by value (each group ascending)."""
    order = np.argsort(key_X, kind="stable")
    keys, starts = np.unique(key_X[order], return_index=True)
    bounds = np.append(starts, order.shape[0])
    return {int(k): order[bounds[i] : bounds[i + 1]] for i, k in enumerate(keys.tolist())}


class DfsMode(Mode):
    """AReaL-DTA's depth-first traversal with a bounded graph; gradients equal ``dense`` (module doc).

    The backward runs inside the call: the returned `ModeResult` has ``backward_done`` set and a
    detached loss, so callers use ``result.backward()`` (a no-op here) whatever the mode.
    """

    name = "dfs"

    def __init__(self, attention: str = "auto", *, chunk_rows: int = 4096, block_size: int | None = 2048,
                 keep_tokens: int = 0, order: str = "backward", sft_fast_path: bool = True,
                 subtree_calls: bool = True) -> None:
        if attention == "sdpa":
            raise ConfigError("attention 'sdpa' runs independent causal sequences; dfs mode needs a tree kernel "
                              "(auto, reference, flex or triton) for its cached prefix")
        if block_size is not None and block_size < 0:
            raise ConfigError(f"dfs block size must be >= 0 (0: unlimited), got {block_size}")
        if keep_tokens < 0:
            raise ConfigError(f"dfs keep tokens must be >= 0, got {keep_tokens}")
        if order not in ORDERS:
            raise ConfigError(f"dfs order must be one of {', '.join(ORDERS)}, got {order!r}")
        super().__init__(attention, chunk_rows=chunk_rows)
        self.block_size = block_size or None
        self.keep_tokens = keep_tokens
        self.order = order
        self.sft_fast_path = sft_fast_path
        self.subtree_calls = subtree_calls

    def schedule(self, pack: Pack, rows: LossRows | None = None) -> Schedule:
        """The traversal of ``pack`` (numpy only; no model needed). With ``rows``, subtrees whose tokens no
        loss row reads are pruned (`needed_tokens`)."""
        needed_T = None if rows is None else needed_tokens(pack, rows)
        try:
            return plan(np.asarray(pack.parent[: pack.n_real]), needed_T=needed_T, block_size=self.block_size,
                        keep_tokens=self.keep_tokens, order=self.order, subtree_calls=self.subtree_calls)
        except ValueError as exc:
            raise LayoutError(f"dfs: {exc}") from None

    def __call__(self, model: Decoder, pack: Pack, rows: LossRows, objective: Objective,
                 totals: BatchTotals) -> ModeResult:
        return _Traversal(self, model, pack, rows, objective, totals).run()


class _Traversal:
    """One pack's DFS: runs the schedule's steps against the model, the path cache and the loss rows."""

    def __init__(self, mode: DfsMode, model: Decoder, pack: Pack, rows: LossRows, objective: Objective,
                 totals: BatchTotals) -> None:
        self.mode, self.model, self.objective = mode, model, objective
        self.dev = dev = model.device
        fast = mode.sft_fast_path and objective.kind == "sft"
        self.targets = _Targets(pack, rows, totals, objective, fast)
        self.schedule = mode.schedule(pack, rows)
        self.targets.assign(self.schedule, int(pack.n_real))
        row_dtype = _row_dtype(model)
        self.weight_U = None if not fast else torch.as_tensor(self.targets.weight_U, dtype=row_dtype, device=dev)
        self.tensors = {} if fast else objective.row_tensors(rows, totals, device=dev, dtype=row_dtype)
        # int64 copies: shard readers hand out read-only Arrow-backed arrays, which torch must not alias
        self.ids_T = torch.as_tensor(np.array(pack.input_ids, dtype=np.int64), device=dev)
        self.pos_T = torch.as_tensor(np.array(pack.position_ids, dtype=np.int64), device=dev)
        self.logp_U = torch.zeros(self.targets.token_U.shape[0], dtype=row_dtype, device=dev)
        self.loss = torch.zeros((), dtype=torch.float64, device=dev)
        self.index = self._upload_indices()
        self.cache: _PathCache | None = None
        self.kept: dict[int, tuple[Tensor | None, list[KV]]] = {}  # lo -> (loss, K/V) of a kept segment
        self.contexts: dict[int, AttentionContext] = {}
        self.work = {"grad_tokens": 0, "anchor_tokens": 0, "backward_tokens": 0, "model_calls": 0}
        self.live = self.peak_live = 0  # tokens whose graph is alive (kept segments + the current call)

    def _upload_indices(self) -> dict[tuple[str, int], Tensor]:
        """Every step's index arrays, copied to the device in one transfer: a host-to-device copy from
        pageable memory waits for the GPU's queue to drain, so one per step would serialise host and GPU."""
        targets = self.targets
        arrays: dict[tuple[str, int], np.ndarray] = {}
        for k, step in enumerate(self.schedule.steps):
            arrays["tokens", k] = step.tokens_C
            if step.is_tree:
                arrays["subtree_end", k] = step.subtree_end_C
            u_idx = targets.u_of_step.get(k)
            if u_idx is None or step.kind not in ("grad", "keep"):
                continue
            arrays["u", k] = u_idx
            arrays["local", k] = targets.local_U[u_idx]
            arrays["target", k] = targets.token_U[u_idx]
            if self.weight_U is None:
                r_idx = targets.rows_of_step[k]
                arrays["rows", k] = r_idx
                arrays["at", k] = np.searchsorted(u_idx, targets.row_u_R[r_idx])
        arrays["row_u", -1] = targets.row_u_R
        flat = np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays.values()]) if arrays else np.zeros(0, np.int64)
        flat_t = torch.as_tensor(flat, device=self.dev)
        out, offset = {}, 0
        for key, a in arrays.items():
            out[key] = flat_t[offset : offset + a.shape[0]]
            offset += a.shape[0]
        return out

    def run(self) -> ModeResult:
        for k, step in enumerate(self.schedule.steps):
            getattr(self, "_" + step.kind)(k, step)
        dev = self.dev
        logp_R = self.logp_U[self.index["row_u", -1]]
        s = self.schedule
        metrics = {
            **self.work,
            "anchor_share": self.work["anchor_tokens"] / max(self.work["grad_tokens"] + self.work["anchor_tokens"], 1),
            "peak_graph_tokens": self.peak_live,
            "kv_rows": s.max_depth,
            "kv_cache_bytes": self.cache.nbytes if self.cache is not None else 0,
            "leaves": s.n_leaves,
            "pruned_tokens": s.n_pruned,
        }
        if dev.type == "cuda":
            metrics["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        if self.objective.kind == "grpo":
            metrics["clip_fraction"] = self.objective.clip_fraction(logp_R, self.tensors.get("behaviour_logp_R"))
        return ModeResult(loss=self.loss, logp_R=logp_R, forward_tokens=self.work["grad_tokens"] +
                          self.work["anchor_tokens"], metrics=metrics, backward_done=True)

    # -- the four step kinds ------------------------------------------------------------------------

    def _anchor(self, k: int, step: Step) -> None:
        with torch.no_grad():
            out = self._forward(k, step, grad=False, return_kv=True)
        self._cache_for(out.kv).write(step.lo, out.kv)
        self.work["anchor_tokens"] += step.n

    def _keep(self, k: int, step: Step) -> None:
        out = self._forward(k, step, grad=True, return_kv=True)
        self._cache_for(out.kv).write(step.lo, out.kv)
        self.kept[step.lo] = (self._step_loss(k, out.hidden_TD), out.kv)
        self.work["grad_tokens"] += step.n
        self.live += step.n
        self.peak_live = max(self.peak_live, self.live)

    def _grad(self, k: int, step: Step) -> None:
        out = self._forward(k, step, grad=True, return_kv=step.kv_grad)
        self.work["grad_tokens"] += step.n
        self.peak_live = max(self.peak_live, self.live + step.n)
        self._backward(step, self._step_loss(k, out.hidden_TD), out.kv)

    def _release(self, k: int, step: Step) -> None:
        loss, kv = self.kept.pop(step.lo)
        self._backward(step, loss, kv)
        self.live -= step.n

    # -- helpers ------------------------------------------------------------------------------------

    def _cache_for(self, kv: list[KV]) -> _PathCache:
        if self.cache is None:
            self.cache = _PathCache(len(kv), max(self.schedule.max_depth, 1), kv[0][0])
        return self.cache

    def _context(self, k: int, step: Step) -> AttentionContext:
        """Causal attention over a chain of n tokens (every token's subtree ends at n), plus the prefix;
        or the mask of a whole tree forwarded in one call."""
        n = step.n
        ctx = None if step.is_tree else self.contexts.get(n)
        if ctx is None:
            if step.is_tree:
                subtree_end_T = self.index["subtree_end", k].to(torch.int32)
            else:
                subtree_end_T = torch.full((n,), n, dtype=torch.int32, device=self.dev)
            if self.dev.type == "cuda":  # valid by construction: skip prepare's host sync
                from treepack.kernels import prepare

                ctx = AttentionContext(kind="tree", impl=self.mode.attention, mask=prepare(subtree_end_T, validate=False))
            else:
                ctx = AttentionContext.tree(subtree_end_T, self.mode.attention)
            if not step.is_tree:
                self.contexts[n] = ctx
        return ctx

    def _forward(self, k: int, step: Step, *, grad: bool, return_kv: bool):
        tok_C = self.index["tokens", k]
        past = self.cache.prefix(step.lo, grad=grad) if step.lo else None
        self.work["model_calls"] += 1
        return self.model(self.ids_T[tok_C], self.pos_T[tok_C], self._context(k, step), past_kv=past,
                          return_kv=return_kv)

    def _step_loss(self, k: int, hidden_CD: Tensor) -> Tensor | None:
        """This step's share of the loss: the rows whose hidden state (the target's parent) it computed."""
        if ("u", k) not in self.index:
            return None
        u_X, index = self.index["u", k], self.index
        logp_X = target_logprobs(hidden_CD[index["local", k]], self.model.head_weight, self.ids_T[index["target", k]],
                                 self.mode.chunk_rows, compiled=self.model.uses_compiled(self.dev))
        self.logp_U[u_X] = logp_X.detach().to(self.logp_U.dtype)
        if self.weight_U is not None:
            loss = -(self.weight_U[u_X] * logp_X).sum()
        else:
            r_X = index["rows", k]
            loss = self.objective.loss(logp_X[index["at", k]], **{name: t[r_X] for name, t in self.tensors.items()})
        self.loss += loss.detach().to(torch.float64)
        return loss

    def _backward(self, step: Step, loss: Tensor | None, kv: list[KV]) -> None:
        """Back-propagate the step's loss and the dK/dV its cached rows received; then forget those rows."""
        outs: list[Tensor] = []
        grads: list[Tensor | None] = []
        if loss is not None:
            outs.append(loss)
            grads.append(None)
        if step.kv_grad:
            rows = step.path_rows
            kv_outs, kv_grads = self.cache.outputs_and_grads(step.lo, [(k_[:rows], v_[:rows]) for k_, v_ in kv])
            outs += kv_outs
            grads += kv_grads
        if outs:
            with torch.autocast(self.dev.type, enabled=False):
                torch.autograd.backward(outs, grads)
            self.work["backward_tokens"] += step.n
        if step.kv_grad:
            self.cache.clear(step.lo, step.lo + step.path_rows)


WORK_SUMS = ("grad_tokens", "anchor_tokens", "backward_tokens", "pruned_tokens", "model_calls", "leaves")
WORK_PEAKS = ("peak_graph_tokens", "kv_rows", "kv_cache_bytes", "cuda_peak_bytes")


def merge_work(total: dict, metrics: dict) -> dict:
    """Add one pack's dfs accounting (`DfsMode` metrics) to a running total: counts add, peaks take the
    maximum, ``anchor_share`` is recomputed. Metrics of other modes leave the total unchanged."""
    out = dict(total)
    for key in WORK_SUMS:
        if key in metrics:
            out[key] = out.get(key, 0) + metrics[key]
    for key in WORK_PEAKS:
        if key in metrics:
            out[key] = max(out.get(key, 0), metrics[key])
    if "anchor_tokens" in out:
        out["anchor_share"] = out["anchor_tokens"] / max(out["grad_tokens"] + out["anchor_tokens"], 1)
    return out
