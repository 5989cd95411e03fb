"""The sharing-aware balance of a global batch over K ranks (treepack.pack.balance, treepack.pack.cost)
against naive references: exact work of a pack in each layout, exact run costs of every contiguous run of
its sequences (tokens, predicted tokens and pairs, in every layout), pieces that rebuild the pack's
sequences, every piece's predicted cost equal to its sub-pack's recomputed from scratch (a wrong remainder
cost otherwise agrees with itself), Algorithm 4 against brute force, and a balance that never does worse
than whole packs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists

from treepack.errors import TreepackError
from treepack.pack.balance import (
    KEEP_WHOLE,
    MIN_GAIN,
    assign_units,
    balance_units,
    split_contiguous,
    split_run,
    sub_pack,
)
from treepack.pack.cost import FlopModel, Work, pack_run_costs, pack_work, rollout_run_costs, run_costs
from treepack.pack.layout import build_pack, relayout

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKENS, PREDICTED, PAIRS = FlopModel(1, 0, 0), FlopModel(0, 1, 0), FlopModel(0, 0, 1)
CALLS = FlopModel(0, 0, 0, per_call=1)  # one a piece: a run of any length is one model call


@st.composite
def packs(draw, max_seqs: int = 10):
    """A pack of sequences sharing prefixes, with random loss masks (some all ones)."""
    seqs = draw(sequence_lists(max_seqs=max_seqs, max_len=7, vocab=3))
    all_ones = draw(st.booleans())
    masks = [[1] * len(s) if all_ones else draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s)))
             for s in seqs]
    return build_pack(rollouts_from(seqs, masks=masks)), seqs, masks, all_ones


def naive_work(seqs, masks, layout: str) -> Work:
    """Work from the sequences themselves: the trie as a set of prefixes."""
    rows = {(tuple(s[: j + 1])) for s, m in zip(seqs, masks) for j in range(1, len(s)) if m[j]}
    if layout == "tree":
        nodes = {tuple(s[: j + 1]) for s in seqs for j in range(len(s))}
        return Work(len(nodes), len(rows), sum(len(p) for p in nodes), calls=1)
    if layout == "flat":
        return Work(sum(map(len, seqs)), sum(m[j] for s, m in zip(seqs, masks) for j in range(1, len(s))),
                    sum(len(s) * (len(s) + 1) // 2 for s in seqs), calls=1)
    distinct = sorted({tuple(s) for s in seqs})
    leaves = [s for s in distinct if not any(o != s and o[: len(s)] == s for o in distinct)]
    return Work(sum(map(len, leaves)), len(rows), sum(len(s) * (len(s) + 1) // 2 for s in leaves), calls=1)


@FAST
@given(packs())
def test_pack_work_equals_the_naive_count(case):
    pack, seqs, masks, _ = case
    for layout in ("tree", "flat", "leaf"):
        assert pack_work(pack, layout) == naive_work(seqs, masks, layout), layout


@FAST
@given(packs(), st.booleans())
def test_run_costs_are_exact_for_every_run(case, largest_first):
    """Every run [a, b) of the pack's sequences priced by RunCosts equals the work of the piece built from
    it, in every layout and term (tokens, predicted tokens, pairs), loss masks that differ on shared tokens
    included; vectorised heads and tails agree with ``run``."""
    pack = relayout(case[0], "largest-first") if largest_first else case[0]
    n = pack.n_sequences
    for layout in ("tree", "flat", "leaf"):
        price = {name: pack_run_costs(pack, flops, layout) for name, flops in (("t", TOKENS), ("p", PREDICTED),
                                                                               ("q", PAIRS), ("c", CALLS))}
        assert price["t"].whole == price["t"].run(0, n) == pack_work(pack, layout).tokens
        for a in range(n):
            for b in range(a + 1, n + 1):
                work = pack_work(sub_pack(pack, a, b), layout)
                got = Work(price["t"].run(a, b), price["p"].run(a, b), price["q"].run(a, b), price["c"].run(a, b))
                assert got == work, (layout, a, b)
            for c in price.values():
                stops = np.arange(a + 1, n + 1)
                assert c.heads(a, stops).tolist() == [c.run(a, s) for s in stops]
                assert c.tails(np.arange(a + 1), a + 1).tolist() == [c.run(s, a + 1) for s in range(a + 1)]
                assert [c.step(a, s) for s in range(a + 1, n)] == [c.run(a, s + 1) - c.run(a, s) for s in range(a + 1, n)]


def test_a_later_sequence_training_on_shared_context_is_priced_exactly():
    """[1 2 3 | 4] trains on 4; [1 2 3 4 | 5] only on 5; [1 2 3 4 6] trains on 4 again: a run of the last two
    predicts 4 once (the middle one does not train on it), the whole pack once too."""
    pack = build_pack(rollouts_from([[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6]],
                                    masks=[[0, 0, 0, 1], [0, 0, 0, 0, 1], [0, 0, 0, 1, 1]]))
    price = pack_run_costs(pack, PREDICTED)
    assert [price.run(a, b) for a, b in ((0, 3), (1, 3), (2, 3), (1, 2), (0, 2))] == [3, 3, 2, 1, 2]
    assert price.extra_seq.tolist() == [2] and price.extra_prev.tolist() == [0]


@FAST
@given(packs(), st.data())
def test_sub_pack_keeps_every_sequence_field(case, data):
    pack, _, _, _ = case
    n = pack.n_sequences
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    piece = sub_pack(pack, a, b)

    def by_record(p, lo, hi):
        return {int(p.seq_index[s]): (p.sequence_tokens(s).tolist(), p.seq_loss_mask[p.seq_offsets[s]:p.seq_offsets[s + 1]]
                                      .tolist(), p.seq_ids[s]) for s in range(lo, hi)}

    assert by_record(piece, 0, piece.n_sequences) == by_record(pack, a, b)
    # In any layout of the pack, the piece keeps its order: tokens and sequences as they come in the pack.
    for whole in (pack, relayout(pack, "largest-first")):
        piece = sub_pack(whole, a, b)
        assert piece.seq_index.tolist() == whole.seq_index[a:b].tolist()
        in_whole = np.full(piece.n_real, -1)
        for s in range(piece.n_sequences):
            in_whole[piece.path(s)] = whole.path(a + s)
        assert (np.diff(in_whole) > 0).all()
    # a piece (and a piece of it) knows the whole pack's size: it runs that pack's attention kernel
    assert piece.meta["piece"] == [a, b] and piece.meta["piece_of_tokens"] == pack.n_real
    assert sub_pack(piece, 0, 1).meta["piece_of_tokens"] == pack.n_real


def test_rollout_run_costs_match_the_pack_of_the_same_sequences():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3], [7, 8], [1, 6]]
    r = rollouts_from(seqs, masks=[[0, 1, 1, 1], [0, 0, 1], [1, 1, 1], [0, 1], [1, 1]])
    order, costs = rollout_run_costs(r, flops=PAIRS)
    assert costs.whole == pack_work(build_pack(r)).pairs
    assert [seqs[i] for i in order] == sorted(seqs)  # lexicographic, a prefix before its extensions


@FAST
@given(packs())
def test_rollout_run_costs_are_exact_for_every_run(case):
    """The same prices from rollouts (no pack built): every run of the lexicographic order costs what a pack
    built from the run's sequences costs, in every layout."""
    _, seqs, masks, _ = case
    r = rollouts_from(seqs, masks=masks)
    flops = FlopModel(7, 5, 3)
    for layout in ("tree", "flat", "leaf"):
        order, costs = rollout_run_costs(r, flops=flops, layout=layout)
        n = len(order)
        for a in range(n):
            for b in range(a + 1, n + 1):
                run = r.select(order[a:b])
                assert costs.run(a, b) == flops.cost(pack_work(build_pack(run), layout)), (layout, a, b)


@st.composite
def trie_runs(draw):
    """Lengths and LCPs of sequences in a DFS leaf order (each LCP at most both neighbours' lengths), and
    a FLOP model: the costs split_run sees for real tries."""
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=7))
    lcp = [0] + [draw(st.integers(0, min(a, b))) for a, b in itertools.pairwise(lengths)]
    flops = draw(st.sampled_from([TOKENS, PAIRS, FlopModel(3, 0, 1)]))
    return np.array(lengths), np.array(lcp), flops


@settings(max_examples=150, deadline=None)
@given(trie_runs(), st.integers(1, 4))
def test_split_run_equals_brute_force(case, m):
    """Algorithm 4 with LCP-aware costs: the minimum bottleneck over every cut into at most m pieces (the
    greedy is optimal because a sub-run never costs more than its run: fewer sequences, a smaller trie)."""
    lengths, lcp, flops = case
    zeros = np.zeros(len(lengths), np.int64)
    costs = run_costs(lengths, lcp, zeros, zeros, flops)
    n = len(lengths)
    starts = split_run(costs, m)
    got = max(costs.run(a, b) for a, b in itertools.pairwise([*starts, n]))
    best = min(max(costs.run(a, b) for a, b in itertools.pairwise((0, *cut, n)))
               for k in range(min(m, n)) for cut in itertools.combinations(range(1, n), k))
    assert starts[0] == 0 and len(starts) <= m and got == best
    exact = split_run(costs, m, exactly=True)  # the paper's lines 30-32: split further, never costlier
    assert len(exact) == min(m, n)
    assert max(costs.run(a, b) for a, b in itertools.pairwise([*exact, n])) <= got


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(1, 4))
def test_assign_units_within_lpt_bound_and_never_worse_than_contiguous(costs, k):
    def bottleneck(ranks):
        return max(sum(c for c, r in zip(costs, ranks) if r == x) for x in range(k))

    got = bottleneck(assign_units(costs, k))
    optimum = min(bottleneck(r) for r in itertools.product(range(k), repeat=len(costs)))
    assert got <= bottleneck(split_contiguous(costs, k))
    assert got * 3 * k <= optimum * (4 * k - 1)  # LPT's bound: (4/3 - 1/(3k)) x optimum


@FAST
@given(st.lists(packs(max_seqs=6), min_size=1, max_size=4), st.integers(1, 6))
def test_balance_covers_every_sequence_once_and_never_loses_to_whole_packs(cases, k):
    flops = FlopModel.named("qwen3-0.6b")
    units = [pack_run_costs(c[0], flops) for c in cases]
    split = balance_units(units, k)
    for u, unit in enumerate(units):
        spans = sorted((p.start, p.stop) for p in split.pieces if p.unit == u)
        assert spans[0][0] == 0 and spans[-1][1] == unit.n
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(spans))
    loads = [0] * k
    for p, r in zip(split.pieces, split.ranks):
        loads[r] += p.cost
    assert loads == split.loads
    whole = balance_units(units, k, min_gain=KEEP_WHOLE)
    assert not whole.split_units
    assert max(split.loads) <= max(whole.loads)
    if split.split_units:  # a cut must have bought at least MIN_GAIN of step time
        assert max(split.loads) < max(whole.loads) * (1 - MIN_GAIN)
    else:  # nothing cut: the whole split itself, rank for rank
        assert split == whole


def test_a_lone_pack_is_cut_where_little_is_shared():
    """Two trees in one pack over two ranks: the cut falls between the trees (nothing duplicated)."""
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10], [1, 2, 3, 4, 5, 6, 7, 11],
            [20, 21, 22, 23, 24, 25, 26, 27, 28], [20, 21, 22, 23, 24, 25, 26, 29], [20, 21, 22, 23, 24, 25, 30]]
    pack = build_pack(rollouts_from(seqs))
    split = balance_units([pack_run_costs(pack, TOKENS)], 2)
    assert sorted((p.start, p.stop) for p in split.pieces) == [(0, 3), (3, 6)]
    assert sum(split.loads) == pack_work(pack).tokens  # nothing computed twice
    assert (split.cut_cost, split.cut_share) == (0, 0.0)


def test_a_comb_cut_over_two_ranks_costs_what_the_ranks_compute():
    """A comb (each sequence branches one token earlier than the last) of 10 tree tokens over 2 ranks: 7 and
    7 tokens, the shared prefix 1 2 3 4 computed on both: 4 tokens (40%) that cutting adds. Pricing the
    remainder without its shared prefix predicted 6 and 4 (and cut elsewhere: the ranks computed 6 and 9)."""
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 8], [1, 2, 3, 9], [1, 2, 10]]
    pack = build_pack(rollouts_from(seqs))
    split = balance_units([pack_run_costs(pack, TOKENS)], 2)
    assert [(p.start, p.stop, p.cost) for p in split.pieces] == [(0, 2, 7), (2, 5, 7)]
    assert split.loads == [pack_work(sub_pack(pack, p.start, p.stop)).tokens for p in split.pieces] == [7, 7]
    assert (split.cut_cost, split.cut_share) == (4, 0.4)
    pytest.importorskip("torch")
    from treepack.train.distributed import shard_batch

    share = shard_batch([pack], flops=TOKENS, rank=0, world_size=2)
    assert share.table(1) == [("split of step 1 over 2 ranks (1 of 1 packs cut, recomputing 4 tokens (+40.0% tokens); "
                               "cost: tokens of the tree layout):"),
                              "  rank 0: 1 packs | 7 tokens (50.0%)", "  rank 1: 1 packs | 7 tokens (50.0%)",
                              "  imbalance 0.0% (costliest rank / mean - 1)"]
    assert {k: share.to_json()[k] for k in ("rank_cost", "split_packs", "cut_tokens", "cut_cost")} == {
        "rank_cost": [7, 7], "split_packs": 1, "cut_tokens": 4, "cut_cost": 4}


def test_errors():
    with pytest.raises(TreepackError, match="number of ranks must be >= 1"):
        balance_units([], 0)
    with pytest.raises(TreepackError, match="layout must be one of tree, flat, leaf"):
        pack_work(build_pack(rollouts_from([[1, 2]])), "dense")
    with pytest.raises(TreepackError, match="unknown model 'gpt'"):
        FlopModel.named("gpt")


def test_shard_batch_partitions_the_batch():
    """Every rank's share together is the batch, sequence for sequence; the totals are the batch's."""
    pytest.importorskip("torch")
    from treepack.train.distributed import shard_batch
    from treepack.train.losses import BatchTotals, LossRows

    rng = np.random.default_rng(0)
    batch = []
    for t in range(3):
        prompt = rng.integers(1, 50, 6 + 4 * t).tolist()
        seqs = [prompt + rng.integers(1, 50, int(rng.integers(2, 8))).tolist() for _ in range(3 + t)]
        batch.append(build_pack(rollouts_from(seqs, ids=[f"{t}/{i}" for i in range(len(seqs))])))
    flops = FlopModel.named("qwen3-0.6b")
    expected = sorted((p.seq_ids[s], tuple(p.sequence_tokens(s).tolist())) for p in batch for s in range(p.n_sequences))
    for world in (1, 2, 3, 5, 8):
        shares = [shard_batch(batch, flops=flops, rank=r, world_size=world) for r in range(world)]
        got = sorted((p.seq_ids[s], tuple(p.sequence_tokens(s).tolist()))
                     for sh in shares for p in sh.packs for s in range(p.n_sequences))
        assert got == expected
        assert all(sh.totals == BatchTotals.of([LossRows.from_pack(p) for p in batch]) for sh in shares)
        assert all(sh.rank_cost == shares[0].rank_cost for sh in shares)  # every rank computes the same split
        assert [sum(flops.cost(pack_work(p)) for p in sh.packs) for sh in shares] == shares[0].rank_cost
        assert shares[0].split.loads == shares[0].rank_cost  # the balance's prediction is what the ranks compute
    assert shard_batch(batch, flops=flops, rank=0, world_size=8).n_split_packs > 0  # 3 packs, 8 ranks: cut


def recomputed_cost(pack, start: int, stop: int, flops: FlopModel, layout: str) -> int:
    """The cost of sequences [start, stop) of ``pack`` from scratch: a new pack built over exactly them."""
    seqs = [pack.sequence_tokens(s).tolist() for s in range(start, stop)]
    masks = [np.asarray(pack.seq_loss_mask[pack.seq_offsets[s]:pack.seq_offsets[s + 1]]).tolist()
             for s in range(start, stop)]
    return flops.cost(pack_work(build_pack(rollouts_from(seqs, masks=masks)), layout))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(packs(max_seqs=8), min_size=1, max_size=4), st.integers(1, 6),
       st.sampled_from(["tree", "flat", "leaf"]),
       st.sampled_from([TOKENS, PREDICTED, PAIRS, FlopModel(3, 2, 1), FlopModel(3, 2, 1, per_call=50),
                        FlopModel.named("qwen3-0.6b")]),
       st.sampled_from([MIN_GAIN, 0.0]), st.booleans())
def test_every_piece_costs_what_its_sub_pack_costs(cases, k, layout, flops, min_gain, largest_first):
    """The balance's predicted cost of every piece, whole or cut, is the cost of the pack the piece becomes,
    recomputed from its sequences alone; every rank's predicted load is the sum of its pieces' recomputed
    costs, and what cutting costs is the recomputed pieces of the cut packs less the packs themselves.
    (``min_gain`` 0 keeps every cut that helps at all, so cuts come often.)"""
    pack_list = [relayout(c[0], "largest-first") if largest_first else c[0] for c in cases]
    units = [pack_run_costs(p, flops, layout) for p in pack_list]
    split = balance_units(units, k, min_gain=min_gain)
    loads = [0] * k
    pieces_of_cut = 0
    for piece, rank in zip(split.pieces, split.ranks):
        pack = pack_list[piece.unit]
        want = recomputed_cost(pack, piece.start, piece.stop, flops, layout)
        assert piece.cost == want, (piece, want)
        assert piece.cost == flops.cost(pack_work(sub_pack(pack, piece.start, piece.stop), layout))
        loads[rank] += want
        if piece.unit in split.split_units:
            pieces_of_cut += want
    assert split.loads == loads
    whole = sum(recomputed_cost(pack_list[u], 0, pack_list[u].n_sequences, flops, layout) for u in split.split_units)
    assert split.cut_cost == pieces_of_cut - whole >= 0
