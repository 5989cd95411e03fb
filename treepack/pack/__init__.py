"""From a prefix tree to packs on disk: which sequences share a pack, each pack's layout, the shards.

- `strategies`: ``pack_sequences`` (best / first-fit / dfs / optimal) -> ``Packing`` under a capacity;
- `packs`: ``pack_rollouts``, the one way from rollouts to laid-out packs (one pack, a strategy's packs, or
  whole trees as ``treepack train`` packs rollout files);
- `packers`: the forest (O(1) LCPs, exact pack costs) and the one-pass packers over it;
- `multipath`: Tree Training's multi-path packing DP (exact on small steps, beam otherwise);
- `balance`: K-way DFS-contiguous split of a global batch for data-parallel ranks;
- `layout`: ``Pack``, one pack's tokens in DFS preorder with parent, subtree_end, scale, loss_weight;
- `shards`: Parquet shards + manifest.json (``write_shards``); `shard_reader`: ``read_packs``, ``unpack``,
  ``read_inputs`` (rollout files, or a pack directory unpacked: what every command reads), ``check_packs``;
  `integrity`: what the manifest promises about its shards and the checks every reader makes.
Needs numpy and pyarrow only.
"""

from treepack.pack.balance import BALANCE_COSTS, Balance, balance_packs, pack_costs, split_contiguous
from treepack.pack.layout import Pack, build_pack
from treepack.pack.packs import pack_rollouts
from treepack.pack.shard_reader import read_inputs, read_manifest, read_packs, unpack
from treepack.pack.shards import write_shards
from treepack.pack.strategies import OVERSIZE, STRATEGIES, Packing, compare_strategies, pack_sequences

__all__ = [
    "BALANCE_COSTS", "OVERSIZE", "STRATEGIES", "Balance", "Pack", "Packing", "balance_packs", "build_pack",
    "compare_strategies", "pack_costs", "pack_rollouts", "pack_sequences", "read_inputs", "read_manifest",
    "read_packs", "split_contiguous", "unpack", "write_shards",
]
