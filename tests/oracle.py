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
        ends_here = set(p[-1] for p in self.paths)
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
    """The §4 numbers by walking a dict trie token by token (fast enough for a few million tokens)."""
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
