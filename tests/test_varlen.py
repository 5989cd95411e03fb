"""Varlen causal attention (treepack.kernels.varlen) on the CPU: the chain-forest test against a dense-mask
oracle, and the dispatch's answers off CUDA (GPU numerics: tests/test_varlen_gpu.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.kernels import chains_subtree_end
from treepack.kernels.varlen import CausalBatch, causal_varlen_attention, chain_forest_lengths
from treepack.kernels.varlen.api import pick_varlen, varlen_unsupported_reason
from treepack.kernels.varlen.reference import causal_attention_reference


@st.composite
def preorder_trees(draw, max_tokens: int = 24):
    """subtree_end of a random forest in DFS preorder: each token's parent is a node on the previous token's
    path (or none: a new root), so branch points, chains and single-token trees all occur."""
    T = draw(st.integers(1, max_tokens))
    chainy = draw(st.booleans())  # half the examples are forests of chains, the case the detector finds
    path: list[int] = []
    parent = []
    for _ in range(T):
        if chainy:
            keep = len(path) if (path and draw(st.integers(0, 3))) else 0
        else:
            keep = draw(st.integers(0, len(path)))
        path = path[:keep]
        parent.append(path[-1] if path else -1)
        path.append(len(parent) - 1)
    end = np.arange(1, T + 1)
    for t in range(T - 1, -1, -1):
        if parent[t] >= 0:
            end[parent[t]] = max(end[parent[t]], end[t])
    return end


def dense_mask(end_T: np.ndarray) -> np.ndarray:
    T = len(end_T)
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    return (k <= q) & (q < end_T[None, :])


def chains_by_mask(end_T: np.ndarray):
    """The oracle: cut where a token does not see its predecessor, then compare the whole mask with
    block-diagonal causal attention over those pieces."""
    M = dense_mask(end_T)
    T = len(end_T)
    cuts = [0] + [q for q in range(1, T) if not M[q, q - 1]] + [T]
    lengths = tuple(b - a for a, b in itertools.pairwise(cuts))
    block = dense_mask(np.repeat(np.cumsum(lengths), lengths))
    return lengths if np.array_equal(M, block) else None


@settings(max_examples=300, deadline=None)
@given(preorder_trees())
def test_chain_forests_are_found_exactly(end_T):
    assert chain_forest_lengths(end_T) == chains_by_mask(end_T)
    assert chain_forest_lengths(torch.as_tensor(end_T, dtype=torch.int32)) == chains_by_mask(end_T)


@pytest.mark.parametrize("lengths", [(1,), (5,), (3, 1, 4), (1, 1, 1, 1), (97, 128, 3)])
def test_chains_subtree_end_round_trips(lengths):
    assert chain_forest_lengths(chains_subtree_end(list(lengths))) == lengths


def test_a_branch_is_not_a_chain():
    # a b -> (c d | e): the picture in tree_attention's docstring
    assert chain_forest_lengths(np.array([5, 5, 4, 4, 5])) is None
    assert chain_forest_lengths(np.zeros(0, dtype=np.int64)) is None


def test_causal_varlen_equals_the_tree_reference_on_cpu():
    """The sdpa path of a forest of chains equals the tree kernel's reference over the same mask (float64)."""
    from treepack.kernels import tree_attention

    g = torch.Generator().manual_seed(0)
    lengths = [7, 1, 33, 12]
    T = sum(lengths)
    q = torch.randn(T, 4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(T, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(T, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    out = causal_varlen_attention(q, k, v, lengths)
    ref = tree_attention(q, k, v, chains_subtree_end(lengths), impl="reference")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_auto_is_the_per_sequence_path_off_cuda():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    assert pick_varlen(q) == "sdpa"
    assert varlen_unsupported_reason("fa4", q) == "the fa4 varlen backend needs CUDA tensors, got cpu"
    with pytest.raises(ValueError, match="impl='flash': the flash varlen backend needs CUDA tensors, got cpu"):
        causal_varlen_attention(q, q[:, :1], q[:, :1], [4], impl="flash")
    with pytest.raises(ValueError, match="sequence lengths sum to 5, tokens T=4"):
        causal_varlen_attention(q, q[:, :1], q[:, :1], [2, 3])
    assert CausalBatch.of([2, 3]).max_len == 3 and CausalBatch.of([2, 3]).cu_seqlens_S1 is None


def test_reference_is_todays_dense_path():
    """`causal_attention_reference` is bit for bit the per-sequence SDPA the dense baselines always ran."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(20, 4, 8, generator=g)
    k = torch.randn(20, 2, 8, generator=g)
    v = torch.randn(20, 2, 8, generator=g)
    out = causal_attention_reference(q, k, v, [20])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(2, 0)[None],
        v.transpose(0, 1).repeat_interleave(2, 0)[None], is_causal=True)[0].transpose(0, 1)
    assert torch.equal(out, ref)


@settings(max_examples=200, deadline=None)
@given(preorder_trees(max_tokens=40))
def test_leaf_paths_compute_the_tree_mask_exactly(end_T):
    """Each query once, over its leaf's gathered path, causal at the bottom right: the tree's pairs, and the
    tree reference's output and gradients in float64."""
    from treepack.kernels import tree_attention, visible_pairs
    from treepack.kernels.varlen.paths import DevicePaths, paths_attention, plan_paths

    plan = plan_paths(end_T)
    T = len(end_T)
    assert plan.cu_q_S1[-1] == T and plan.pairs == visible_pairs(torch.as_tensor(end_T, dtype=torch.int32))
    for s in range(plan.num_segments):  # a segment's queries are its path's last keys
        q0, q1, k1 = plan.cu_q_S1[s], plan.cu_q_S1[s + 1], plan.cu_k_S1[s + 1]
        assert plan.key_index_N[k1 - (q1 - q0):k1].tolist() == list(range(q0, q1))
    assert plan.padded_pairs() >= plan.pairs
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, h, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    out = paths_attention(q, k, v, DevicePaths.of(plan, "cpu"), impl="sdpa")
    ref = tree_attention(q, k, v, torch.as_tensor(end_T, dtype=torch.int32), impl="reference")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(preorder_trees(max_tokens=40))
def test_the_path_gather_sums_every_copy_of_a_key(end_T):
    """The keys' gather (`paths._GatherPaths`): each token's own copy once, the extra copies after, and the
    backward equal to ``index_select``'s in float64."""
    from treepack.kernels.varlen.paths import DevicePaths, _GatherPaths, plan_paths

    plan = plan_paths(end_T)
    T, N = len(end_T), plan.key_index_N.shape[0]
    assert plan.key_index_N[plan.own_T].tolist() == list(range(T))
    assert sorted(plan.own_T.tolist() + plan.extra_X.tolist()) == list(range(N))
    paths = DevicePaths.of(plan, "cpu")
    g = torch.Generator().manual_seed(T)
    k, v = (torch.randn(T, 2, 3, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    dk, dv = (torch.randn(N, 2, 3, dtype=torch.float64, generator=g) for _ in range(2))
    k_N, v_N = _GatherPaths.apply(k, v, paths)
    assert torch.equal(k_N, k[paths.key_index_N]) and torch.equal(v_N, v[paths.key_index_N])
    got = torch.autograd.grad((k_N, v_N), (k, v), (dk, dv))
    want = torch.autograd.grad((k.index_select(0, paths.key_index_N), v.index_select(0, paths.key_index_N)), (k, v), (dk, dv))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_paths_pay_on_chains_not_on_short_branches():
    from treepack.kernels.varlen.paths import paths_pay, plan_paths

    assert paths_pay(plan_paths(chains_subtree_end([4096, 2048]).numpy()))
    # a 4K-token root with 300 one-token leaves: each leaf's tile holds 1 of 128 rows
    star = np.concatenate([np.full(4096, 4096 + 300), np.arange(4097, 4097 + 300)])
    assert not paths_pay(plan_paths(star))
