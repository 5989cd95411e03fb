"""CPU tests of tree attention: the reference against per-path causal attention, the mask helpers and the
block schedule, validation messages, gradients, FlexAttention's forward, and the Triton kernels under the
Triton interpreter (a subprocess with TRITON_INTERPRET=1, tiny sizes).

Core invariant (attention-gym's shared-prefix test): tree attention over a packed tree equals ordinary
causal attention over each root-to-leaf path run as its own sequence, at every token, in float64.

Shape suffixes: T pack tokens, P prefix tokens, L path length, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from treepack.kernels import chains_subtree_end, prepare, tree_attention, tree_mask, visible_pairs
from treepack.kernels.tree_attention.reference import tree_attention_reference

# ----------------------------------------------------------------------------------------------------
# Tree factories and the per-path oracle (the GPU tests import these)
# ----------------------------------------------------------------------------------------------------


def subtree_end_from_parent(parent: list[int]) -> torch.Tensor:
    """subtree_end (int32 [T]) of a DFS-preorder parent array (-1 at roots)."""
    T = len(parent)
    size = [1] * T
    for i in range(T - 1, -1, -1):
        if parent[i] >= 0:
            size[parent[i]] += size[i]
    return torch.tensor([i + size[i] for i in range(T)], dtype=torch.int32)


def random_parent(T: int, rng: np.random.Generator, branch: float = 0.25, new_root: float = 0.02) -> list[int]:
    """A random tree in DFS preorder: each token continues the current path or branches off an ancestor."""
    parent, path = [], []
    for i in range(T):
        if path and rng.random() < new_root:
            path = []
        elif path and rng.random() < branch:
            path = path[: int(rng.integers(1, len(path) + 1))]
        parent.append(path[-1] if path else -1)
        path.append(i)
    return parent


def random_subtree_end(T: int, seed: int, **kw) -> torch.Tensor:
    return subtree_end_from_parent(random_parent(T, np.random.default_rng(seed), **kw))


def star_subtree_end(root_len: int, n_leaves: int, leaf_len: int) -> torch.Tensor:
    """A shared root chain with n_leaves sibling chains of leaf_len tokens (hundreds of siblings)."""
    parent = list(range(-1, root_len - 1))
    for _ in range(n_leaves):
        parent.append(root_len - 1)
        parent.extend(range(len(parent) - 1, len(parent) - 1 + leaf_len - 1))
    return subtree_end_from_parent(parent)


def padded_subtree_end(subtree_end_T: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad a pack to a multiple of ``multiple`` tokens; padding tokens attend only themselves."""
    T = subtree_end_T.numel()
    pad = -T % multiple
    return torch.cat([subtree_end_T, torch.arange(T + 1, T + pad + 1, dtype=torch.int32)])


def root_to_leaf_paths(subtree_end_T: torch.Tensor) -> list[torch.Tensor]:
    """Token indices of every root-to-leaf path (a leaf has subtree_end = itself + 1)."""
    mask_TT = tree_mask(subtree_end_T)
    leaves = (subtree_end_T == torch.arange(1, subtree_end_T.numel() + 1)).nonzero().flatten()
    return [mask_TT[leaf].nonzero().flatten() for leaf in leaves.tolist()]


def causal_attention(q_BLHD, k_BSKD, v_BSKD, scale: float, prefix_len: int = 0):
    """Plain causal softmax attention of B sequences of one length (S = prefix_len + L keys, the prefix
    seen by all)."""
    L, H = q_BLHD.shape[1], q_BLHD.shape[2]
    G = H // k_BSKD.shape[2]
    k_BSHD, v_BSHD = k_BSKD.repeat_interleave(G, 2), v_BSKD.repeat_interleave(G, 2)
    scores_BHLS = torch.einsum("blhd,bshd->bhls", q_BLHD, k_BSHD) * scale
    pos_L, pos_S = torch.arange(L), torch.arange(k_BSKD.shape[1]) - prefix_len
    scores_BHLS = scores_BHLS.masked_fill(pos_S[None, :] > pos_L[:, None], float("-inf"))
    return torch.einsum("bhls,bshd->blhd", scores_BHLS.softmax(-1), v_BSHD)


def per_path_oracle(q_THD, k_TKD, v_TKD, subtree_end_T, scale, prefix_k=None, prefix_v=None):
    """Run every root-to-leaf path as its own causal sequence; return [T, H, D] (each token once).

    Paths of equal length run as one batch."""
    out_THD = torch.full_like(q_THD, float("nan"))
    P = 0 if prefix_k is None else prefix_k.shape[0]
    written = np.zeros(q_THD.shape[0], dtype=bool)
    by_length: dict[int, list[torch.Tensor]] = {}
    for path_L in root_to_leaf_paths(subtree_end_T):
        by_length.setdefault(path_L.numel(), []).append(path_L)
    for paths in by_length.values():
        path_BL = torch.stack(paths)
        k_BSKD, v_BSKD = k_TKD[path_BL], v_TKD[path_BL]
        if P:
            B = path_BL.shape[0]
            k_BSKD = torch.cat([prefix_k.expand(B, *prefix_k.shape), k_BSKD], dim=1)
            v_BSKD = torch.cat([prefix_v.expand(B, *prefix_v.shape), v_BSKD], dim=1)
        out_BLHD = causal_attention(q_THD[path_BL], k_BSKD, v_BSKD, scale, P)
        # write each token once (shared tokens sit on many paths), so gradients count each token once
        tokens, first = np.unique(path_BL.flatten().numpy(), return_index=True)
        new = ~written[tokens]
        out_THD[torch.from_numpy(tokens[new])] = out_BLHD.flatten(0, 1)[torch.from_numpy(first[new])]
        written[tokens] = True
    return out_THD


def make_qkv(T, H, K, D, dtype=torch.float64, seed=0, P=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    q, k, v = rand(T, H, D), rand(T, K, D), rand(T, K, D)
    pk, pv = (rand(P, K, D), rand(P, K, D)) if P else (None, None)
    return q, k, v, pk, pv


# ----------------------------------------------------------------------------------------------------
# Reference vs per-path causal attention
# ----------------------------------------------------------------------------------------------------

TREES = {
    "one_token": lambda: torch.tensor([1], dtype=torch.int32),
    "two_roots": lambda: torch.tensor([1, 2], dtype=torch.int32),
    "random_97": lambda: random_subtree_end(97, seed=1),
    "random_128": lambda: random_subtree_end(128, seed=2, branch=0.4),
    "random_130": lambda: random_subtree_end(130, seed=3, branch=0.1),
    "deep_chain_300": lambda: chains_subtree_end([300]),
    "star_300_siblings": lambda: star_subtree_end(root_len=5, n_leaves=300, leaf_len=1),
    "star_ragged": lambda: star_subtree_end(root_len=3, n_leaves=40, leaf_len=3),
    "forest_of_chains": lambda: chains_subtree_end([1, 7, 30, 2, 60]),
    "padded_to_128": lambda: padded_subtree_end(random_subtree_end(97, seed=4), 128),
}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
def test_reference_equals_per_path_causal(tree, heads):
    subtree_end_T = TREES[tree]()
    H, K = heads
    q, k, v, _, _ = make_qkv(subtree_end_T.numel(), H, K, 16, seed=len(tree))
    scale = 1 / math.sqrt(16)
    out = tree_attention(q, k, v, subtree_end_T, impl="reference")
    expected = per_path_oracle(q, k, v, subtree_end_T, scale)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("P", [1, 17])
def test_reference_with_prefix_equals_per_path(P):
    subtree_end_T = random_subtree_end(60, seed=5)
    q, k, v, pk, pv = make_qkv(60, 4, 2, 8, seed=6, P=P)
    out = tree_attention(q, k, v, subtree_end_T, prefix_k=pk, prefix_v=pv, scale=0.3, impl="reference")
    expected = per_path_oracle(q, k, v, subtree_end_T, 0.3, pk, pv)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_padding_tokens_attend_only_themselves():
    subtree_end_T = padded_subtree_end(random_subtree_end(20, seed=7), 32)
    q, k, v, _, _ = make_qkv(32, 2, 2, 8)
    out = tree_attention(q, k, v, subtree_end_T, impl="reference")
    torch.testing.assert_close(out[20:], v[20:], rtol=0, atol=1e-15)


def test_duplicate_subtrees_give_equal_outputs():
    # root (3 tokens) with two identical branches of 4 tokens: same q/k/v -> same outputs
    subtree_end_T = star_subtree_end(root_len=3, n_leaves=2, leaf_len=4)
    q, k, v, _, _ = make_qkv(11, 4, 2, 8)
    for t in (q, k, v):
        t[7:11] = t[3:7]
    out = tree_attention(q, k, v, subtree_end_T, impl="reference")
    torch.testing.assert_close(out[7:11], out[3:7], rtol=0, atol=1e-15)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_reference_chunking_invariance(chunk_size):
    subtree_end_T = random_subtree_end(130, seed=8)
    q, k, v, pk, pv = make_qkv(130, 4, 2, 8, P=5)
    kw = {"prefix_k_PKD": pk, "prefix_v_PKD": pv, "scale": 0.25}
    whole = tree_attention_reference(q, k, v, subtree_end_T, chunk_size=4096, **kw)
    chunked = tree_attention_reference(q, k, v, subtree_end_T, chunk_size=chunk_size, **kw)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-14)


def test_reference_default_chunk_respects_score_budget():
    subtree_end_T = random_subtree_end(200, seed=9)
    q, k, v, _, _ = make_qkv(200, 2, 1, 8)
    small = tree_attention_reference(q, k, v, subtree_end_T, scale=0.3, score_budget=2 * 16 * 200)
    whole = tree_attention_reference(q, k, v, subtree_end_T, scale=0.3)
    torch.testing.assert_close(small, whole, rtol=0, atol=1e-14)


def test_reference_gradcheck():
    subtree_end_T = random_subtree_end(9, seed=10)
    q, k, v, pk, pv = make_qkv(9, 2, 1, 4, P=2)
    inputs = [t.requires_grad_() for t in (q, k, v, pk, pv)]

    def fn(q, k, v, pk, pv):
        return tree_attention(q, k, v, subtree_end_T, prefix_k=pk, prefix_v=pv, impl="reference")

    assert torch.autograd.gradcheck(fn, inputs)


def test_reference_gradients_through_checkpointed_chunks():
    subtree_end_T = random_subtree_end(40, seed=11)
    q, k, v, pk, pv = make_qkv(40, 4, 2, 8, P=3)
    grads = []
    for chunk_size in (5, 4096):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, pk, pv)]
        out = tree_attention_reference(
            *inputs[:3], subtree_end_T, prefix_k_PKD=inputs[3], prefix_v_PKD=inputs[4], scale=0.3,
            chunk_size=chunk_size,
        )
        grads.append(torch.autograd.grad(out.square().sum(), inputs))
    for chunked, whole in zip(*grads):
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)


def test_gradients_equal_per_path_gradients():
    # Tree gradients equal the sum over paths of per-path gradients when each token's loss is counted once.
    subtree_end_T = random_subtree_end(30, seed=12)
    q, k, v, _, _ = make_qkv(30, 2, 1, 8)
    w = torch.randn(30, 2, 8, dtype=torch.float64)
    tree_in = [t.clone().requires_grad_() for t in (q, k, v)]
    tree_grads = torch.autograd.grad((tree_attention(*tree_in, subtree_end_T, impl="reference") * w).sum(), tree_in)
    path_in = [t.clone().requires_grad_() for t in (q, k, v)]
    path_grads = torch.autograd.grad((per_path_oracle(*path_in, subtree_end_T, 1 / math.sqrt(8)) * w).sum(), path_in)
    for a, b in zip(tree_grads, path_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_auto_on_cpu_is_reference():
    subtree_end_T = random_subtree_end(50, seed=13)
    q, k, v, _, _ = make_qkv(50, 2, 2, 8, dtype=torch.float32)
    assert torch.equal(tree_attention(q, k, v, subtree_end_T), tree_attention(q, k, v, subtree_end_T, impl="reference"))


def test_empty_pack():
    q, k, v, _, _ = make_qkv(0, 2, 1, 8)
    assert tree_attention(q, k, v, torch.zeros(0, dtype=torch.int32)).shape == (0, 2, 8)


# ----------------------------------------------------------------------------------------------------
# Mask helpers and the block schedule
# ----------------------------------------------------------------------------------------------------


def test_tree_mask_picture():
    # root a b, branches (c d) and (e): e skips its sibling branch
    mask = tree_mask(torch.tensor([5, 5, 4, 4, 5], dtype=torch.int32), prefix_len=1).int().tolist()
    assert mask == [
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]


def test_chains_subtree_end_is_block_causal():
    subtree_end_T = chains_subtree_end([3, 1, 2])
    assert subtree_end_T.tolist() == [3, 3, 3, 4, 6, 6] and subtree_end_T.dtype == torch.int32
    seq_T = torch.tensor([0, 0, 0, 1, 2, 2])
    pos_T = torch.arange(6)
    expected = (seq_T[:, None] == seq_T[None, :]) & (pos_T[None, :] <= pos_T[:, None])
    assert torch.equal(tree_mask(subtree_end_T), expected)
    with pytest.raises(ValueError, match=r"lengths must be a 1-d list of positive ints, got \[2, 0\]"):
        chains_subtree_end([2, 0])


def test_visible_pairs():
    subtree_end_T = random_subtree_end(77, seed=14)
    assert visible_pairs(subtree_end_T) == int(tree_mask(subtree_end_T).sum())
    assert visible_pairs(subtree_end_T, prefix_len=5) == int(tree_mask(subtree_end_T, 5).sum())


@pytest.mark.parametrize("tree", ["random_97", "random_128", "star_ragged", "forest_of_chains", "padded_to_128"])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32), (64, 16)])
def test_prepare_schedule_matches_dense_blocks(tree, blocks):
    subtree_end_T = TREES[tree]()
    bm, bn = blocks
    info = prepare(subtree_end_T, block_m=bm, block_n=bn)
    T = subtree_end_T.numel()
    mask_TT = tree_mask(subtree_end_T)
    M, N = -(-T // bm), -(-T // bn)
    for m in range(M):
        full, partial = [], []
        for n in range(N):
            tile = mask_TT[m * bm : (m + 1) * bm, n * bn : (n + 1) * bn]
            # a ragged query block may be full (missing rows are never stored); a ragged key block may not
            if tile.all() and tile.shape[1] == bn:
                full.append(n)
            elif tile.any():
                partial.append(n)
        n_full, n_all = int(info.kv_full_M[m]), int(info.kv_count_M[m])
        assert (n_full, n_all) == (len(full), len(full) + len(partial)), f"row {m}"
        assert info.kv_list_MN[m, :n_all].tolist() == full + partial, f"row {m}"
        assert (info.kv_list_MN[m, n_all:] == N).all()
    counts = info.kv_count_M[info.q_order_M.long()]
    assert sorted(info.q_order_M.tolist()) == list(range(M)) and (counts[:-1] >= counts[1:]).all()


def test_prepare_rejects_bad_subtree_end():
    with pytest.raises(ValueError, match=r"^subtree_end must be int32 of shape \[T\], got int64 of shape \[3\]$"):
        prepare(torch.tensor([3, 3, 3]))
    with pytest.raises(ValueError, match=r"^subtree_end must satisfy k < subtree_end\[k\] <= T=3 for every token k, got subtree_end\[1\]=1$"):
        prepare(torch.tensor([3, 1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"got subtree_end\[0\]=4$"):
        prepare(torch.tensor([4, 3, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^block_n must be a power of two, got 48$"):
        prepare(torch.tensor([1], dtype=torch.int32), block_n=48)


def test_tree_mask_info_is_accepted_by_the_api():
    subtree_end_T = random_subtree_end(40, seed=15)
    q, k, v, _, _ = make_qkv(40, 2, 1, 8)
    info = prepare(subtree_end_T)
    assert torch.equal(tree_attention(q, k, v, info, impl="reference"), tree_attention(q, k, v, subtree_end_T, impl="reference"))


# ----------------------------------------------------------------------------------------------------
# Validation messages
# ----------------------------------------------------------------------------------------------------

Q, K_, V = (torch.zeros(97, 4, 64), torch.zeros(97, 2, 64), torch.zeros(97, 2, 64))
SE = torch.arange(1, 98, dtype=torch.int32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"subtree_end": SE.long()}, "subtree_end must be int32 of shape [T]=[97], got int64 of shape [97]"),
        ({"subtree_end": SE[:96]}, "subtree_end must be int32 of shape [T]=[97], got int32 of shape [96]"),
        ({"q": torch.zeros(97, 64)}, "q must have shape [T, Hq, D], got [97, 64]"),
        ({"k": torch.zeros(97, 2, 32)}, "k must have shape [T, Hkv, D]=[97, Hkv, 64], got [97, 2, 32]"),
        ({"k": torch.zeros(96, 2, 64)}, "k must have shape [T, Hkv, D]=[97, Hkv, 64], got [96, 2, 64]"),
        ({"v": torch.zeros(97, 1, 64)}, "v must have the shape of k [97, 2, 64], got [97, 1, 64]"),
        (
            {"k": torch.zeros(97, 3, 64), "v": torch.zeros(97, 3, 64)},
            "query heads Hq=4 must be a multiple of kv heads Hkv=3 (GQA)",
        ),
        (
            {"k": torch.zeros(97, 2, 64, dtype=torch.float16)},
            "q, k and v must share one floating dtype, got q float32, k float16, v float32",
        ),
        (
            {"q": torch.zeros(97, 4, 64, dtype=torch.int32)},
            "q, k and v must share one floating dtype, got q int32, k float32, v float32",
        ),
        ({"prefix_k": torch.zeros(5, 2, 64)}, "prefix_k and prefix_v must be given together"),
        (
            {"prefix_k": torch.zeros(5, 2, 32), "prefix_v": torch.zeros(5, 2, 32)},
            "prefix_k must have shape [P, Hkv, D]=[P, 2, 64], got [5, 2, 32]",
        ),
        (
            {"prefix_k": torch.zeros(5, 2, 64), "prefix_v": torch.zeros(4, 2, 64)},
            "prefix_v must have the shape of prefix_k [5, 2, 64], got [4, 2, 64]",
        ),
        (
            {"prefix_k": torch.zeros(5, 2, 64, dtype=torch.float64), "prefix_v": torch.zeros(5, 2, 64)},
            "prefix_k and prefix_v must have the dtype of q (float32), got float64 and float32",
        ),
        ({"impl": "cuda"}, "impl must be one of 'auto', 'reference', 'flex', 'triton', 'fa4', got 'cuda'"),
        (
            {"subtree_end": prepare(SE[:10])},
            "subtree_end (a TreeMaskInfo) covers T=10 tokens, q has T=97",
        ),
    ],
)
def test_validation_messages(kwargs, message):
    args = {"q": Q, "k": K_, "v": V, "subtree_end": SE}
    args.update(kwargs)
    q, k, v, se = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("subtree_end")
    with pytest.raises(ValueError) as err:
        tree_attention(q, k, v, se, **args)
    assert str(err.value) == message


def test_validation_type_errors():
    with pytest.raises(TypeError, match=r"^subtree_end must be an int32 tensor or a TreeMaskInfo, got list$"):
        tree_attention(Q, K_, V, [1] * 97)
    with pytest.raises(TypeError, match=r"^k must be a torch.Tensor, got ndarray$"):
        tree_attention(Q, np.zeros((97, 2, 64)), V, SE)


def test_triton_on_cpu_without_interpreter_is_refused():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process")
    with pytest.raises(ValueError, match=r"^impl='triton': the triton backend needs CUDA tensors \(or TRITON_INTERPRET=1 on CPU\), got cpu$"):
        tree_attention(Q, K_, V, SE, impl="triton")


def test_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from treepack.kernels import tree_attention\n"
        "q = torch.randn(3, 2, 64)\n"
        "print(tree_attention(q, q, q, torch.tensor([3, 3, 3], dtype=torch.int32)).shape)\n"
        "assert 'triton.language' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert "torch.Size([3, 2, 64])" in res.stdout


# ----------------------------------------------------------------------------------------------------
# FlexAttention (CPU: eager forward only)
# ----------------------------------------------------------------------------------------------------


def _flex_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@pytest.mark.skipif(not _flex_available(), reason="torch has no FlexAttention")
@pytest.mark.parametrize("P", [0, 9])
def test_flex_forward_matches_reference(P):
    subtree_end_T = random_subtree_end(97, seed=16)
    q, k, v, pk, pv = make_qkv(97, 4, 2, 16, dtype=torch.float32, P=P)
    kw = {"prefix_k": pk, "prefix_v": pv}
    out = tree_attention(q, k, v, prepare(subtree_end_T), impl="flex", **kw)
    torch.testing.assert_close(out, tree_attention(q, k, v, subtree_end_T, impl="reference", **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not _flex_available(), reason="torch has no FlexAttention")
def test_flex_backward_on_cpu_is_refused():
    q, k, v, _, _ = make_qkv(4, 2, 2, 16, dtype=torch.float32)
    q.requires_grad_()
    with pytest.raises(ValueError, match=r"^impl='flex': torch's FlexAttention has no backward on CPU; use "
                                         r"'reference' or 'auto' there$"):
        tree_attention(q, k, v, torch.tensor([4, 4, 4, 4], dtype=torch.int32), impl="flex")


# ----------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess: TRITON_INTERPRET must be set before triton loads)
# ----------------------------------------------------------------------------------------------------

INTERPRETER_CASES = {
    # name: (tree, H, K, D, P, dtype, config changes). No bfloat16: the interpreter computes with numpy,
    # which has no bfloat16 (Triton 3.9's interpreter returns garbage for it); the GPU tests cover it.
    "T1": ("one_token", 2, 1, 64, 0, "float32", {}),
    "T37_gqa": ("random_37", 4, 2, 64, 0, "float32", {}),
    "T70_prefix": ("random_70", 2, 1, 64, 21, "float32", {}),
    "T70_fp16_blocks32": ("random_70", 2, 2, 64, 5, "float16", {"fwd_block_m": 32, "dkdv_block_n": 16, "dkdv_block_m": 32}),
    "star_D32": ("star_small", 2, 1, 32, 0, "float32", {"sched_m": 16, "fwd_block_m": 16, "dq_block_m": 16}),
    "chain_D128": ("chain_24", 2, 2, 128, 0, "float32", {}),
    # the fused backward (dQ by atomics from the dK/dV kernel): GQA group 2, ragged T and prefix blocks
    "T37_gqa_fused": ("random_37", 4, 2, 64, 0, "float32", {"fused_bwd": True}),
    "T70_prefix_gqa_fused": ("random_70", 4, 2, 64, 21, "float32", {"fused_bwd": True}),
    "T70_fp16_blocks32_fused": (
        "random_70", 4, 2, 64, 5, "float16", {"fwd_block_m": 32, "dkdv_block_n": 16, "dkdv_block_m": 32, "fused_bwd": True},
    ),
    "T70_fp16_low_lse_fused": ("random_70", 4, 2, 64, 21, "float16", {"fused_bwd": True}),
}
INTERPRETER_TREES = {
    "one_token": lambda: torch.tensor([1], dtype=torch.int32),
    "random_37": lambda: random_subtree_end(37, seed=20, branch=0.3),
    "random_70": lambda: random_subtree_end(70, seed=21, branch=0.3),
    "star_small": lambda: star_subtree_end(root_len=3, n_leaves=20, leaf_len=2),
    "chain_24": lambda: chains_subtree_end([24]),
}


def _low_lse_inputs(q, k, v, pk, pv):
    """Every score q·k/sqrt(D) near -24 (lse ~ -30 in base 2): a zero key of a ragged prefix block gets
    p = 2^-lse, which overflows fp16 in dS (inf · k = 0 is NaN in the fused dQ unless the kernel masks it)."""
    u = torch.randn(q.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = 14 * u / u.norm()
    shift = lambda t, sign: (0.1 * t.double() + sign * u).to(t.dtype)
    return shift(q, 1), shift(k, -1), v, shift(pk, -1), pv


INTERPRETER_INPUTS = {"T70_fp16_low_lse_fused": _low_lse_inputs}


def _interpreter_checks() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: compare kernels with the float64 reference."""
    from dataclasses import replace

    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _probe(X):
            tl.store(X + tl.arange(0, 16), tl.arange(0, 16).to(tl.float32))

        probe = torch.zeros(16)
        _probe[(1,)](probe)
        assert probe[15] == 15
        from treepack.kernels.tree_attention import triton as tri
    except Exception as e:  # noqa: BLE001 - any failure here means the interpreter cannot run
        print(json.dumps({"skip": f"the Triton interpreter cannot run here: {type(e).__name__}: {e}"}))
        return
    for name, (tree, H, K, D, P, dtype, changes) in INTERPRETER_CASES.items():
        subtree_end_T = INTERPRETER_TREES[tree]()
        T = subtree_end_T.numel()
        dt = getattr(torch, dtype)
        q, k, v, pk, pv = INTERPRETER_INPUTS.get(name, lambda *t: t)(*make_qkv(T, H, K, D, dtype=dt, seed=T + D, P=P))
        inputs = [t.requires_grad_() for t in (q, k, v, pk, pv) if t is not None]
        cfg = replace(tri.PINNED, **changes)

        def run(cfg, inputs=inputs, subtree_end_T=subtree_end_T, P=P):
            return tri.tree_attention_triton(
                *inputs[:3], subtree_end_T, prefix_k=inputs[3] if P else None, prefix_v=inputs[4] if P else None,
                config=cfg,
            )

        out = run(cfg)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dt)
        grads = torch.autograd.grad(out, inputs, dout)
        vs_split = {}
        if cfg.fused_bwd:  # the split backward on the same inputs and tiles
            split_grads = torch.autograd.grad(run(replace(cfg, fused_bwd=False)), inputs, dout)
            for gname, g, sg in zip(["dq", "dk", "dv", "dpk", "dpv"], grads, split_grads):
                vs_split[gname] = (g.double() - sg.double()).abs().max().item()
        ref_in = [t.detach().double().requires_grad_() for t in inputs]
        ref = tree_attention_reference(
            *ref_in[:3], subtree_end_T, prefix_k_PKD=ref_in[3] if P else None,
            prefix_v_PKD=ref_in[4] if P else None, scale=1 / math.sqrt(D),
        )
        ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
        errs = {"out": (out.double() - ref).abs().max().item()}
        for gname, g, rg in zip(["dq", "dk", "dv", "dpk", "dpv"], grads, ref_grads):
            errs[gname] = (g.double() - rg).abs().max().item()
        finite = all(bool(g.isfinite().all()) for g in grads)
        print(json.dumps({"case": name, "errs": errs, "vs_split": vs_split, "finite": finite}))
    # torch.library registration: schema, fake tensors and autograd wiring
    subtree_end_T = INTERPRETER_TREES["random_37"]()
    info = tri.schedule_for(subtree_end_T, tri.PINNED)
    q, k, v, _, _ = make_qkv(37, 2, 1, 32, dtype=torch.float32)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, None, info.subtree_end_T,
            info.kv_list_MN, info.kv_full_M, info.kv_count_M, info.q_order_M, 0.2, tri.PINNED.as_list())
    torch.library.opcheck(tri.tree_attention_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    print(json.dumps({"opcheck": "ok"}))


def test_pinned_launch_falls_back_to_fewer_stages():
    pytest.importorskip("triton", reason="triton is not installed")
    from triton.runtime.errors import OutOfResources

    from treepack.kernels.tree_attention import triton as tri

    calls = []

    class FakeKernel:  # fits in shared memory with at most 2 stages
        class fn:
            __name__ = "fake_kernel"

        def __getitem__(self, grid):
            def launch(*args, num_stages, **kw):
                calls.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(300000, 232448, "shared memory")

            return launch

    args = (torch.zeros(1),)
    tri._launch_fitting(FakeKernel(), (1,), args, {"HEAD_DIM": 64}, 4, num_warps=8)
    tri._launch_fitting(FakeKernel(), (1,), args, {"HEAD_DIM": 64}, 4, num_warps=8)
    assert calls == [4, 3, 2, 2]  # the second launch starts from the stage count that fitted
    with pytest.raises(OutOfResources):

        class NeverFits(FakeKernel):
            def __getitem__(self, grid):
                def launch(*args, num_stages, **kw):
                    raise OutOfResources(300000, 232448, "shared memory")

                return launch

        tri._launch_fitting(NeverFits(), (1,), args, {"HEAD_DIM": 128}, 2, num_warps=8)


@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, __file__, "--interpreter-checks"], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    if lines and "skip" in lines[0]:
        pytest.skip(lines[0]["skip"])
    assert res.returncode == 0, res.stderr[-4000:]
    return lines


# Float32 kernels vs float64 reference: ~1e-6; float16: ~1e-3 (inputs and P rounded to fp16).
TOL = {"float32": 2e-5, "float16": 1e-2}


@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_triton_interpreter_matches_reference(interpreter_results, case):
    (result,) = [r for r in interpreter_results if r.get("case") == case]
    assert result["finite"]
    tol = TOL[INTERPRETER_CASES[case][5]]
    bad = {name: err for name, err in result["errs"].items() if not err <= tol}
    assert not bad, f"{case}: errors above {tol}: {bad} (all: {result['errs']})"


@pytest.mark.parametrize("case", [c for c, spec in INTERPRETER_CASES.items() if spec[6].get("fused_bwd")])
def test_triton_interpreter_fused_bwd_matches_split(interpreter_results, case):
    (result,) = [r for r in interpreter_results if r.get("case") == case]
    tol = TOL[INTERPRETER_CASES[case][5]]
    P = INTERPRETER_CASES[case][4]
    assert set(result["vs_split"]) == ({"dq", "dk", "dv", "dpk", "dpv"} if P else {"dq", "dk", "dv"})
    # dK, dV come from the same kernel code either way; dQ differs only in the order of fp32 additions
    bad = {name: err for name, err in result["vs_split"].items() if not err <= tol}
    assert not bad, f"{case}: fused vs split above {tol}: {bad}"


def test_kernel_config_list_round_trip():
    pytest.importorskip("triton", reason="triton is not installed")
    from dataclasses import replace

    from treepack.kernels.tree_attention import triton as tri

    for cfg in (tri.GPU_DEFAULT, tri.PINNED, replace(tri.PINNED, fused_bwd=True)):
        assert tri.KernelConfig.from_list(cfg.as_list()) == cfg
    old = tri.PINNED.as_list()[:-1]  # a list written before fused_bwd existed
    assert tri.KernelConfig.from_list(old) == tri.PINNED and not tri.KernelConfig.from_list(old).fused_bwd
    assert tri.KernelConfig.from_list(replace(tri.PINNED, fused_bwd=True).as_list()).fused_bwd is True


def test_triton_custom_op_registration(interpreter_results):
    assert {"opcheck": "ok"} in interpreter_results


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    _interpreter_checks()


@pytest.mark.parametrize("prefix", [0, 11])
def test_kernel_ops_count_the_causal_bound_of_flops(prefix):
    """torch's FLOP counter (and through it the activation-budget partitioner) sees the tree kernels' forward
    and backward at 4 and 8 FLOPs per head dimension and causal-bound pair; on fake tensors, no kernel runs."""
    pytest.importorskip("triton", reason="triton is not installed")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from treepack.kernels.tree_attention import triton as _registers_the_ops  # noqa: F401
    from treepack.kernels.tree_attention.ops import causal_pairs_bound

    T, H, K, D = 37, 4, 2, 16
    with FakeTensorMode():
        q, k = torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(T, K, D, dtype=torch.bfloat16)
        pk = torch.empty(prefix, K, D, dtype=torch.bfloat16) if prefix else None
        tables = [torch.empty(5, dtype=torch.int32) for _ in range(5)]
        with FlopCounterMode(display=False) as fwd:
            out, lse = torch.ops.treepack.tree_attention_fwd(q, k, k, pk, pk, *tables, 0.1, [64, 64, 4, 2])
        with FlopCounterMode(display=False) as bwd:
            torch.ops.treepack.tree_attention_bwd(out, q, k, k, pk, pk, out, lse, *tables, 0.1, [64, 64, 4, 2])
    pairs = causal_pairs_bound(T, prefix)
    assert pairs == sum(prefix + i + 1 for i in range(T))
    assert fwd.get_total_flops() == 4 * H * D * pairs
    assert bwd.get_total_flops() == 8 * H * D * pairs
