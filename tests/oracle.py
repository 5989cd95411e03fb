"""Naive references the tests compare against: a dict-of-dicts trie walked token by token.

Deliberately simple and slow; children are visited in ascending token order, which is the layout
order treepack uses, so token-level arrays can be compared exactly.
"""

from __future__ import annotations


class NaiveTrie:
    def __init__(self, seqs, scopes=None):
        self.roots: dict = {}
        self.seqs = [list(map(int, s)) for s in seqs]
        self.scopes = list(scopes) if scopes is not None else [0] * len(self.seqs)
        for s, sc in zip(self.seqs, self.scopes):
            node = self.roots.setdefault(sc, {})
            for t in s:
                child = node.get(t)
                if child is None:
                    child = node[t] = {}
                node = child
        self._layout()

    def _layout(self):
        """DFS preorder over (scope, token) with sorted children: ids, depth, parent, subtree_end, paths."""
        self.ids, self.depth, self.parent, self.subtree_end, self.n_children = [], [], [], [], []
        index_of = {}

        def visit(node, depth, parent, key):
            for t in sorted(node):
                me = len(self.ids)
                self.ids.append(t)
                self.depth.append(depth)
                self.parent.append(parent)
                self.subtree_end.append(None)
                self.n_children.append(len(node[t]))
                index_of[key + (t,)] = me
                stack.append((node[t], depth + 1, me, key + (t,)))
                # recursive preorder
                visit_child = stack.pop()
                visit(*visit_child)
                self.subtree_end[me] = len(self.ids)

        stack = []
        for sc in sorted(self.roots):
            visit(self.roots[sc], 0, -1, (sc,))
        self.paths = []
        for s, sc in zip(self.seqs, self.scopes):
            key = (sc,)
            path = []
            for t in s:
                key = key + (t,)
                path.append(index_of[key])
            self.paths.append(path)

    @property
    def n_tree(self):
        return len(self.ids)

    @property
    def n_flat(self):
        return sum(len(s) for s in self.seqs)

    def count(self):
        """Sequences whose path contains each token."""
        c = [0] * len(self.ids)
        for p in self.paths:
            for t in p:
                c[t] += 1
        return c

    def leaves(self):
        """Distinct sequences (scope, tokens) that are not a proper prefix of another in the same scope."""
        distinct = {(sc, tuple(s)) for s, sc in zip(self.seqs, self.scopes)}
        out = []
        for sc, s in distinct:
            end = self.paths[[(c, tuple(x)) for x, c in zip(self.seqs, self.scopes)].index((sc, s))][-1]
            if self.subtree_end[end] == end + 1:
                out.append((sc, s))
        return out

    def n_nodes(self):
        """Compressed nodes: maximal chains whose tokens have one child and no sequence ends inside."""
        ends_here = {p[-1] for p in self.paths}
        n = 0
        for t in range(len(self.ids)):
            par = self.parent[t]
            if par == -1 or self.n_children[par] != 1 or par in ends_here:
                n += 1
        return n


def ancestor_mask(parent):
    """mask[q][k] = k is q or an ancestor of q, from parent chains."""
    n = len(parent)
    mask = [[False] * n for _ in range(n)]
    for q in range(n):
        k = q
        while k != -1:
            mask[q][k] = True
            k = parent[k]
    return mask


def naive_stats(seqs, scopes=None):
    """The design §4 numbers by walking a dict trie token by token (fast enough for a few million tokens)."""
    scopes = list(scopes) if scopes is not None else [0] * len(seqs)
    roots: dict = {}
    n_tree = 0
    tree_pairs = 0
    for s, sc in zip(seqs, scopes):
        node = roots.setdefault(sc, {})
        for d, t in enumerate(s):
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                n_tree += 1
                tree_pairs += d + 1
            node = child
    distinct = {(sc, tuple(s)) for s, sc in zip(seqs, scopes)}
    by_scope: dict = {}
    for sc, s in distinct:
        by_scope.setdefault(sc, []).append(s)
    leaves = []
    for sc, group in by_scope.items():
        group.sort()
        for i, s in enumerate(group):
            nxt = group[i + 1] if i + 1 < len(group) else None
            if nxt is None or nxt[: len(s)] != s:
                leaves.append(s)
    n_flat = sum(len(s) for s in seqs)
    flat_pairs = sum(len(s) * (len(s) + 1) // 2 for s in seqs)
    return {
        "n_sequences": len(seqs),
        "n_flat_tokens": n_flat,
        "n_tree_tokens": n_tree,
        "compression": n_flat / n_tree,
        "por": 1 - n_tree / n_flat,
        "c_leaf": sum(len(s) for s in leaves) / n_tree,
        "c_attn": flat_pairs / tree_pairs,
        "n_leaves": len(leaves),
        "max_depth": max(len(s) for s in seqs),
    }


def trie_tokens(seqs, scopes=None) -> int:
    """Tokens of the union trie of some sequences (sharing only within a scope)."""
    scopes = [0] * len(seqs) if scopes is None else scopes
    return len({(sc, tuple(s[: k + 1])) for s, sc in zip(seqs, scopes) for k in range(len(s))})


def areal_first_fit(seqs, max_tokens):
    """AReaL's ``_greedy_build_tries`` (areal/models/tree_attn/tree.py), re-implemented on dict tries:
    sequences in input order, each inserted into the first trie where the new nodes it needs keep the
    trie within ``max_tokens``, else into a new trie. Returns the list of packs (input indices)."""
    forests = []  # [root dict, token count, members]
    for i, seq in enumerate(seqs):
        for forest in forests:
            node, additional = forest[0], 0
            for k, tok in enumerate(seq):
                if tok not in node:
                    additional = len(seq) - k
                    break
                node = node[tok]
            if forest[1] + additional <= max_tokens:
                break
        else:
            if len(seq) > max_tokens:
                raise ValueError(f"Sequence length {len(seq)} exceeds max_tokens_per_tree {max_tokens}")
            forest = [{}, 0, []]
            forests.append(forest)
            additional = len(seq)
        node = forest[0]
        for tok in seq:
            node = node.setdefault(tok, {})
        forest[1] += additional
        forest[2].append(i)
    return [f[2] for f in forests]


def set_partitions(items):
    """Every partition of a list into non-empty blocks (Bell(n) of them: keep n small)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in set_partitions(rest):
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1 :]
        yield [[first]] + p


def brute_force_packing(seqs, capacity, scopes=None, batches=None):
    """Minimum total trie tokens over every partition into packs of <= capacity (packs within a batch)."""
    n = len(seqs)
    scopes = [0] * n if scopes is None else scopes
    batches = [0] * n if batches is None else batches
    total = 0
    for b in sorted(set(batches)):
        idx = [i for i in range(n) if batches[i] == b]
        best = None
        for part in set_partitions(idx):
            costs = [trie_tokens([seqs[i] for i in blk], [scopes[i] for i in blk]) for blk in part]
            if max(costs) <= capacity and (best is None or sum(costs) < best):
                best = sum(costs)
        total += best
    return total
