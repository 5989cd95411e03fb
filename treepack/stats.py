"""The numbers of docs/design.md §4 for a prefix tree, the FLOP model, and the CI data-quality gate.

- ``compression`` C = N_flat / N_tree; ``por`` = 1 - N_tree / N_flat (the prefix-sharing rate);
- ``c_leaf`` = tokens of the distinct sequences that are not a proper prefix of another / N_tree;
- ``c_attn`` = sum_i L_i (L_i + 1) / 2 / sum over trie tokens of (depth + 1): attention-pair compression
  (each trie token at depth d attends to its d + 1 ancestors-or-self);
- ideal speedups 1 / (1 - POR) (= C) and, with packing, 1 / (1 - ERR); and the FLOP-model speedup
  dense FLOPs / tree FLOPs for a model shape (FLOPs of fwd+bwd: 6 x non-embedding params x tokens
  + 6 x d_model x vocab x predicted tokens + 12 x layers x heads x head_dim x visible attention pairs).
Everything is computed from the PrefixTree's sequence- and node-level arrays in O(n + V), never per token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from treepack.errors import TreepackError
from treepack.io.rollouts import Rollouts
from treepack.tree import PrefixTree


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, enough for the FLOP model."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int

    @property
    def non_embedding_params(self) -> int:
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.d_model * self.d_ff
        return self.n_layers * (attn + mlp)

    def flops(self, tokens: float, predicted: float, attention_pairs: float) -> float:
        """fwd+bwd FLOPs of one pass over ``tokens`` with ``attention_pairs`` visible (q, k) pairs."""
        return (
            6.0 * self.non_embedding_params * tokens
            + 6.0 * self.d_model * self.vocab * predicted
            + 12.0 * self.n_layers * self.n_heads * self.head_dim * attention_pairs
        )


MODEL_SHAPES = {
    m.name: m
    for m in (
        ModelShape("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936),
        ModelShape("qwen3-1.7b", 28, 2048, 16, 8, 128, 6144, 151936),
        ModelShape("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936),
        ModelShape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
        ModelShape("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936),
    )
}
DEFAULT_MODEL = "qwen3-1.7b"


@dataclass
class GroupStats:
    group: object
    n_sequences: int
    n_flat_tokens: int
    n_tree_tokens: int
    compression: float
    saved_tokens: int


@dataclass
class TreeStats:
    """The stats of one batch. ``to_dict`` gives the JSON object of ``treepack stats --json``."""

    n_sequences: int
    n_flat_tokens: int
    n_tree_tokens: int
    compression: float
    por: float
    c_leaf: float
    c_attn: float
    n_nodes: int
    n_leaves: int
    max_depth: int
    mean_depth: float  # mean length of the leaf paths
    mean_seq_len: float
    n_trees: int  # root nodes (distinct first tokens per scope)
    n_scopes: int
    n_duplicates: int  # sequences equal to an earlier one in the same scope
    n_prefix_of_another: int  # distinct sequences that are a proper prefix of another
    ideal_speedup: float  # 1 / (1 - POR)
    attention_pairs_flat: int
    attention_pairs_tree: int
    branching: dict[int, int]  # children -> number of internal nodes with that many children
    max_branching: int
    model: str
    flop_speedup: float  # FLOP model: dense FLOPs / tree FLOPs
    groups: list[GroupStats] = field(default_factory=list)  # top scopes by saved tokens
    n_skipped: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    # filled by packing (treepack stats --capacity)
    capacity: int | None = None
    strategy: str | None = None
    n_packs: int | None = None
    n_pack_tokens: int | None = None
    err: float | None = None
    err_speedup: float | None = None
    n_oversize_skipped: int | None = None  # sequences longer than the capacity, left out of the packs (and of ERR)
    n_packed_flat_tokens: int | None = None  # ERR's N_flat: the packed sequences' tokens (below N_flat if any skipped)

    def rows(self, *, packing: bool = True) -> list[tuple[str, str, str]]:
        """(metric, value, meaning) rows shown by ``treepack stats`` and the HTML report."""
        rows = [
            ("sequences", f"{self.n_sequences:,}", "records read" + (f" ({self.n_skipped:,} skipped)" if self.n_skipped else "")),
            ("N_flat", f"{self.n_flat_tokens:,}", "tokens a dense trainer computes"),
            ("N_tree", f"{self.n_tree_tokens:,}", "tokens in the prefix trie"),
            ("C", f"{self.compression:.3f}", "N_flat / N_tree"),
            ("POR", f"{self.por:.4f}", "1 - N_tree / N_flat"),
            ("C_leaf", f"{self.c_leaf:.3f}", "leaf sequences' tokens / N_tree"),
            ("C_attn", f"{self.c_attn:.3f}", "attention pairs dense / tree"),
            ("ideal speedup", f"{self.ideal_speedup:.2f}x", "1 / (1 - POR)"),
            ("FLOP-model speedup", f"{self.flop_speedup:.2f}x", f"fwd+bwd FLOPs dense / tree, {self.model}"),
        ]
        if packing and self.capacity is not None:
            rows += [
                ("capacity", f"{self.capacity:,}", f"tokens per pack, strategy {self.strategy}"),
                ("packs", f"{self.n_packs:,}", "packs needed"),
                ("N_pack", f"{self.n_pack_tokens:,}", "tokens over all packs"),
                ("ERR", f"{self.err:.4f}", "1 - N_pack / N_flat" + (
                    f" of the packed sequences ({self.n_oversize_skipped:,} longer than the capacity left out)"
                    if self.n_oversize_skipped else "")),
                ("ERR speedup", f"{self.err_speedup:.2f}x", "1 / (1 - ERR)"),
            ]
        return rows + [
            ("nodes", f"{self.n_nodes:,}", "compressed trie nodes"),
            ("leaves", f"{self.n_leaves:,}", "distinct sequences not a prefix of another"),
            ("trees", f"{self.n_trees:,}", f"roots, in {self.n_scopes:,} scope(s)"),
            ("duplicates", f"{self.n_duplicates:,}", "sequences equal to an earlier one"),
            ("prefix-of-another", f"{self.n_prefix_of_another:,}", "distinct sequences extended by another"),
            ("max depth", f"{self.max_depth:,}", "longest path (tokens)"),
            ("mean leaf depth", f"{self.mean_depth:,.1f}", "mean leaf path length (tokens)"),
            ("mean length", f"{self.mean_seq_len:,.1f}", "mean sequence length (tokens)"),
        ]

    def to_dict(self) -> dict:
        """Every field as JSON takes it (``stats --json``, the pack manifest): branching's keys as strings."""
        d = asdict(self)
        d["branching"] = {str(k): v for k, v in self.branching.items()}
        for k in ("capacity", "strategy", "n_packs", "n_pack_tokens", "err", "err_speedup", "n_oversize_skipped",
                  "n_packed_flat_tokens"):
            if d[k] is None:
                del d[k]
        return d


def predicted_tokens(tree: PrefixTree, rollouts: Rollouts | None) -> tuple[int, int]:
    """The head's rows of the FLOP model (design §9's predicted tokens): loss targets, position 0 of a sequence
    excluded (nothing predicts it), per sequence flat; per trie token in the tree, counted at the first
    sequence in DFS order through it (exact where the sequences sharing a token agree on its loss mask). Without
    a loss mask (or without the rollouts) every token is a target."""
    lcp, lengths = tree.lcp, tree.lengths
    if rollouts is None or rollouts.loss_mask is None:
        return tree.n_flat_tokens - int((lengths > 0).sum()), tree.n_tree_tokens - int(((lcp == 0) & (lengths > 0)).sum())
    mask = np.append(np.asarray(rollouts.loss_mask, dtype=np.uint8), 0)  # reduceat's indices may reach the end
    starts = np.asarray(rollouts.offsets, dtype=np.int64)[:-1][tree.order]
    lo, hi = starts + np.maximum(lcp, 1), starts + lengths

    def in_ranges(a: np.ndarray, b: np.ndarray) -> int:
        keep = b > a
        if not keep.any():
            return 0
        idx = np.empty(2 * int(keep.sum()), dtype=np.int64)
        idx[0::2], idx[1::2] = a[keep], b[keep]
        return int(np.add.reduceat(mask, idx, dtype=np.int64)[0::2].sum())

    return in_ranges(starts + 1, hi), in_ranges(lo, hi)


def compute_stats(
    tree: PrefixTree,
    *,
    rollouts: Rollouts | None = None,
    model: str = DEFAULT_MODEL,
    top_groups: int = 10,
) -> TreeStats:
    """All design §4 numbers of a built tree. ``rollouts`` (the batch the tree was built from) adds the skipped-record
    counts and its loss masks, which the FLOP model's head counts as the trained tokens (all tokens without
    it); ``model``: a name of `MODEL_SHAPES`."""
    if model not in MODEL_SHAPES:
        raise TreepackError(f"unknown model shape {model!r}: expected one of {', '.join(MODEL_SHAPES)}")
    n = tree.n_sequences
    L = tree.lengths.astype(np.float64)
    n_flat = tree.n_flat_tokens
    n_tree = tree.n_tree_tokens
    pairs_flat = int((tree.lengths * (tree.lengths + 1) // 2).sum())
    pairs_tree = int(((tree.lengths * (tree.lengths + 1) - tree.lcp * (tree.lcp + 1)) // 2).sum())
    leaf = tree.is_leaf_seq
    leaf_tokens = int(tree.lengths[leaf].sum())
    same_scope = np.zeros(n, dtype=bool)
    if n > 1:
        same_scope[1:] = tree.scope[1:] == tree.scope[:-1]
    dup = same_scope & (tree.lcp == tree.lengths)  # sorted order puts a prefix before its extensions
    n_dup = int(dup.sum())
    n_distinct = n - n_dup
    n_leaves = int(leaf.sum())
    children = tree.node_children
    internal = children[children > 0]
    branching_counts = np.bincount(internal) if len(internal) else np.zeros(0, np.int64)
    branching = {int(k): int(v) for k, v in enumerate(branching_counts) if v}
    shape = MODEL_SHAPES[model]
    predicted_flat, predicted_tree = predicted_tokens(tree, rollouts)
    flops_flat = shape.flops(n_flat, predicted_flat, pairs_flat)
    flops_tree = shape.flops(n_tree, predicted_tree, pairs_tree)
    por = 1.0 - n_tree / n_flat if n_flat else 0.0
    groups = _group_stats(tree, top_groups, tree.scope_names) if tree.scope.max(initial=0) > 0 else []
    st = TreeStats(
        n_sequences=n,
        n_flat_tokens=n_flat,
        n_tree_tokens=n_tree,
        compression=n_flat / n_tree if n_tree else 1.0,
        por=por,
        c_leaf=leaf_tokens / n_tree if n_tree else 1.0,
        c_attn=pairs_flat / pairs_tree if pairs_tree else 1.0,
        n_nodes=tree.n_nodes,
        n_leaves=n_leaves,
        max_depth=int(tree.lengths.max(initial=0)),
        mean_depth=float(tree.lengths[leaf].mean()) if n_leaves else 0.0,
        mean_seq_len=float(L.mean()) if n else 0.0,
        n_trees=int((tree.node_parent < 0).sum()),
        n_scopes=len(np.unique(tree.scope)) if n else 0,
        n_duplicates=n_dup,
        n_prefix_of_another=n_distinct - n_leaves,
        ideal_speedup=1.0 / (1.0 - por) if por < 1 else math.inf,
        attention_pairs_flat=pairs_flat,
        attention_pairs_tree=pairs_tree,
        branching=branching,
        max_branching=int(children.max(initial=0)),
        model=model,
        flop_speedup=flops_flat / flops_tree if flops_tree else 1.0,
        groups=groups,
    )
    if rollouts is not None:
        st.n_skipped = rollouts.n_skipped
        st.skipped = dict(rollouts.skipped)
    return st


def _group_stats(tree: PrefixTree, top: int, names: list | None) -> list[GroupStats]:
    sc = tree.scope
    k = int(sc.max()) + 1
    flat = np.bincount(sc, weights=tree.lengths, minlength=k).astype(np.int64)
    trie = np.bincount(sc, weights=tree.lengths - tree.lcp, minlength=k).astype(np.int64)
    count = np.bincount(sc, minlength=k)
    # first sequence of each scope names it
    first = np.full(k, -1, dtype=np.int64)
    first[sc[::-1]] = np.arange(len(sc) - 1, -1, -1)
    saved = flat - trie
    best = np.argsort(-saved, kind="stable")[:top]
    out = []
    for g in best.tolist():
        if count[g] == 0:
            continue
        label = names[g] if names is not None and g < len(names) else g
        out.append(GroupStats(label, int(count[g]), int(flat[g]), int(trie[g]), float(flat[g] / max(trie[g], 1)), int(saved[g])))
    return out


# --------------------------------------------------------------------------------------------------
# CI gate


@dataclass
class Gate:
    """Thresholds of the data-quality gate; None = not checked."""

    min_compression: float | None = None
    min_por: float | None = None
    max_seq_len: int | None = None
    min_err: float | None = None

    def check(self, st: TreeStats) -> list[str]:
        """Messages naming every failed threshold and its value (empty: the gate passes)."""
        failures = []
        if self.min_compression is not None and not st.compression >= self.min_compression:
            failures.append(f"compression {st.compression:.4f} < --min-compression {self.min_compression:g}")
        if self.min_por is not None and not st.por >= self.min_por:
            failures.append(f"por {st.por:.4f} < --min-por {self.min_por:g}")
        if self.max_seq_len is not None and st.max_depth > self.max_seq_len:
            failures.append(f"max sequence length {st.max_depth} > --max-seq-len {self.max_seq_len}")
        if self.min_err is not None:
            if st.err is None:
                failures.append("--min-err needs --capacity")
            elif not st.err >= self.min_err:
                failures.append(f"err {st.err:.4f} < --min-err {self.min_err:g} (capacity {st.capacity})")
        return failures
