"""`treepack.pack.layout.relayout`: a pack laid out children largest subtree first is the same pack.

Checked against naive references on random forests (shared prefixes, duplicates, prefix-of-another
sequences, several scopes, partial loss masks, NaN log-probs, padding): the token order equals a
recursive DFS with children sorted by (subtree size descending, lexicographic), every sequence (tokens,
positions, loss mask, log-probs, per-sequence fields) equals the original's of the same id, the mask
contract holds (``{k : k <= q < subtree_end[k]}`` = q and its ancestors by ``parent``), scale and
loss_weight are those of the sequences' paths; and a float64 tiny model's tree-mode loss, log-probs and
gradients on the relaid pack equal those on the lexicographic pack.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import ancestor_mask
from strategies import rollouts_from, sequence_lists

from treepack.errors import TreepackError
from treepack.pack.layout import CHILD_ORDERS, Pack, build_pack, preorder_by_key, relayout
from treepack.tree import scope_codes

PER_TOKEN = ("input_ids", "position_ids", "parent", "subtree_end", "scale", "loss_weight")


@st.composite
def packs(draw, max_seqs: int = 10):
    """A pack of random rollouts with every optional field, a subset of them, scopes and padding."""
    seqs = draw(sequence_lists(max_seqs=max_seqs, max_len=9, vocab=3))
    n = len(seqs)
    masks = [draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs]
    ids = [f"s{i}" if i % 2 else i for i in range(n)]  # unique, mixed types
    r = rollouts_from(seqs, masks=masks, ids=ids)
    groups = [draw(st.sampled_from(["t1", "t2"])) for _ in range(n)]
    r.group_names = sorted(set(groups))
    r.groups = np.asarray([r.group_names.index(g) for g in groups], dtype=np.int64)
    r.steps = np.asarray(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int64)
    floats = st.one_of(st.just(math.nan), st.floats(-3, 0))
    if draw(st.booleans()):
        r.logprobs = np.asarray([draw(floats) for _ in range(r.n_tokens)], dtype=np.float64)
    if draw(st.booleans()):
        r.advantages = np.asarray([draw(st.floats(-2, 2)) for _ in range(n)])
        r.rewards = np.asarray([draw(st.sampled_from([0.0, 1.0, math.nan])) for _ in range(n)])
    index = np.asarray(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)), dtype=np.int64)
    scope = scope_codes(r, "tree_id")[0] if draw(st.booleans()) else None
    return build_pack(r, index, scope=scope, pad_to=draw(st.sampled_from([None, 4, 16])))


def naive_children(parent: list[int]) -> tuple[dict[int, list[int]], list[int]]:
    """Children of each token (-1: the roots) and subtree sizes, from parent chains alone."""
    kids: dict[int, list[int]] = {}
    size = [1] * len(parent)
    for k, p in enumerate(parent):
        kids.setdefault(p, []).append(k)
        while p != -1:
            size[p] += 1
            p = parent[p]
    return kids, size


def naive_largest_first(pack: Pack) -> list[int]:
    """Old index of each new position: recursive DFS, children by (size descending, current order)."""
    parent = pack.parent[: pack.n_real].tolist()
    kids, size = naive_children(parent)
    out: list[int] = []

    def visit(v: int) -> None:
        for c in sorted(kids.get(v, []), key=lambda c: (-size[c], c)):
            out.append(c)
            visit(c)

    visit(-1)
    return out + list(range(pack.n_real, pack.n_tokens))


def seq_fields(pack: Pack, s: int) -> dict:
    """Everything a sequence is, independent of the layout (log-probs bitwise: NaN marks none)."""
    a, b = int(pack.seq_offsets[s]), int(pack.seq_offsets[s + 1])
    path = pack.seq_token_index[a:b]
    out = {"tokens": pack.input_ids[path].tolist(), "positions": pack.position_ids[path].tolist(),
           "mask": pack.seq_loss_mask[a:b].tolist(), "index": int(pack.seq_index[s]),
           "scale": pack.scale[path].tolist(), "loss_weight": pack.loss_weight[path].tolist()}
    if pack.seq_logprobs is not None:
        out["logprobs"] = pack.seq_logprobs[a:b].view(np.int64).tolist()
    for name in ("advantages", "rewards", "seq_steps"):
        if getattr(pack, name) is not None:
            out[name] = np.asarray(getattr(pack, name))[s : s + 1].view(np.int64).tolist()
    if pack.seq_groups is not None:
        out["group"] = pack.seq_groups[s]
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packs())
def test_relayout_is_the_same_pack_children_largest_first(pack):
    assert relayout(pack, "lex") is pack
    new = relayout(pack, "largest-first")
    T, n = pack.n_tokens, pack.n_real
    assert (new.n_tokens, new.n_real, new.meta) == (T, n, pack.meta)
    for name in PER_TOKEN + ("seq_leaf", "seq_token_index", "seq_offsets", "seq_index", "seq_loss_mask"):
        assert getattr(new, name).dtype == getattr(pack, name).dtype, name
    # The token order is the naive DFS's; every per-token array is the original's permuted.
    old = naive_largest_first(pack)
    new_of = {o: i for i, o in enumerate(old)}
    for name in ("input_ids", "position_ids", "scale", "loss_weight"):
        assert getattr(new, name).tolist() == getattr(pack, name)[old].tolist(), name
    assert new.parent.tolist() == [new_of[p] if p >= 0 else -1 for p in pack.parent[old].tolist()]
    size = (pack.subtree_end - np.arange(T))[old]
    assert new.subtree_end.tolist() == (np.arange(T) + size).tolist()
    for name in PER_TOKEN:  # padding exactly as it was
        assert getattr(new, name)[n:].tolist() == getattr(pack, name)[n:].tolist(), name
    # Mask contract: the keys of q are q and its ancestors by parent.
    mask = ancestor_mask(new.parent.tolist())
    end = new.subtree_end.tolist()
    for q in range(T):
        assert [k for k in range(T) if k <= q < end[k]] == [k for k in range(T) if mask[q][k]], q
    # Children (and roots) largest subtree first, ties in the lexicographic (original) order.
    kids, sizes = naive_children(new.parent[:n].tolist())
    for v, cs in kids.items():
        assert [(-sizes[c], old[c]) for c in cs] == sorted((-sizes[c], old[c]) for c in cs), v
    # Every sequence is the original's of the same id; sequences in DFS leaf order, each path a parent chain.
    assert sorted(map(str, new.seq_ids)) == sorted(map(str, pack.seq_ids))
    before = {sid: s for s, sid in enumerate(pack.seq_ids)}
    for s, sid in enumerate(new.seq_ids):
        assert seq_fields(new, s) == seq_fields(pack, before[sid]), sid
        chain, q = [], int(new.seq_leaf[s])
        while q != -1:
            chain.append(q)
            q = int(new.parent[q])
        assert chain[::-1] == new.path(s).tolist()
    leaf = new.seq_leaf.tolist()
    assert leaf == sorted(leaf)
    for a in range(len(leaf) - 1):  # duplicates keep their order
        if leaf[a] == leaf[a + 1]:
            assert before[new.seq_ids[a]] < before[new.seq_ids[a + 1]]
    # scale / loss_weight: the sequences whose path holds the token / that train on predicting it.
    scale, weight = np.zeros(T), np.zeros(T)
    for s in range(new.n_sequences):
        np.add.at(scale, new.path(s), 1)
        m = new.seq_loss_mask[new.seq_offsets[s] : new.seq_offsets[s + 1]].astype(bool)
        m[0] = False
        np.add.at(weight, new.path(s)[m], 1)
    assert new.scale.tolist() == scale.tolist() and new.loss_weight.tolist() == weight.tolist()
    again = relayout(new, "largest-first")  # already largest first: nothing moves
    for name in PER_TOKEN + ("seq_leaf", "seq_token_index", "seq_offsets"):
        assert np.array_equal(getattr(again, name), getattr(new, name)), name
    assert again.seq_ids == new.seq_ids


@settings(max_examples=60, deadline=None)
@given(sequence_lists(max_seqs=10, max_len=8, vocab=3), st.data())
def test_preorder_by_key_is_a_dfs_by_key(seqs, data):
    """Any key: the order of a recursive DFS visiting children by (key, current index)."""
    pack = build_pack(rollouts_from(seqs))
    n = pack.n_real
    key = np.asarray(data.draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n)))
    new = preorder_by_key(pack.parent, pack.subtree_end, key)
    kids, _ = naive_children(pack.parent.tolist())
    order: list[int] = []

    def visit(v: int) -> None:
        for c in sorted(kids.get(v, []), key=lambda c: (key[c], c)):
            order.append(c)
            visit(c)

    visit(-1)
    assert new.tolist() == np.argsort(order).tolist()


def test_bad_arguments():
    pack = build_pack(rollouts_from([[1, 2, 3], [1, 2, 4]]))
    with pytest.raises(TreepackError, match="child order must be one of lex, largest-first, got 'size'"):
        relayout(pack, "size")
    assert CHILD_ORDERS == ("lex", "largest-first")
    with pytest.raises(TreepackError, match="not a DFS preorder"):
        preorder_by_key(np.array([-1, 2, 0]), np.array([3, 3, 3]), np.zeros(3))
    with pytest.raises(TreepackError, match="disagree"):  # subtree_end does not match parent
        preorder_by_key(np.array([-1, 0, 0, 0]), np.array([4, 4, 3, 4]), np.zeros(4))


@pytest.mark.parametrize("mode,options", [
    ("tree", {"attention": "reference"}),
    ("dfs", {"attention": "reference", "dfs": {"block_size": 6, "order": "layout"}}),
    ("dfs", {"attention": "reference", "dfs": {"block_size": 6, "order": "backward"}}),
], ids=["tree", "dfs-layout", "dfs-backward"])
def test_loss_and_gradients_equal_on_the_relaid_pack(mode, options):
    """float64: loss, every row's log-prob (matched by sequence and position) and every parameter gradient
    on the largest-first pack equal those on the lexicographic pack within 1e-10, in tree mode and in dfs
    mode walking the pack (its tree calls and, with [train.dfs] order = layout, its leaf order follow the layout)."""
    torch = pytest.importorskip("torch")
    from test_equivalence import OBJECTIVES, make_pack, random_sequences, rel_diffs, run

    from treepack.train.config import DfsConfig
    from treepack.train.losses import LossRows
    from treepack.train.model import Decoder
    from treepack.train.verify import tiny_model_args

    if "dfs" in options:
        options = {**options, "dfs": DfsConfig(**options["dfs"])}

    model = Decoder.random_init(tiny_model_args(13), seed=0, dtype=torch.float64)
    rng = np.random.default_rng(4)
    seqs = random_sequences(rng, 14)
    lex = make_pack(seqs, 4, groups=[i % 3 for i in range(len(seqs))], pad_to=16)
    new = relayout(lex, "largest-first")
    assert not np.array_equal(new.subtree_end, lex.subtree_end)  # the order did change
    key = {}
    for pack in (lex, new):  # each row as (sequence id, position)
        rows = LossRows.from_pack(pack)
        j_R = rows.flat_R - pack.seq_offsets[rows.seq_R]
        key[id(pack)] = [(pack.seq_ids[s], int(j)) for s, j in zip(rows.seq_R.tolist(), j_R.tolist())]
    for objective in OBJECTIVES:
        loss_l, logp_l, g_l = run(model, [lex], mode, objective, **options)
        loss_n, logp_n, g_n = run(model, [new], mode, objective, **options)
        assert abs(loss_n - loss_l) <= 1e-10 * abs(loss_l)
        by_row = dict(zip(key[id(lex)], logp_l.tolist()))
        assert sorted(by_row) == sorted(key[id(new)])
        assert max(abs(by_row[k] - v) for k, v in zip(key[id(new)], logp_n.tolist())) <= 1e-12
        assert max(rel_diffs(g_n, g_l).values()) <= 1e-10
