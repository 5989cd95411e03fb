"""treepack: find and exploit shared prefixes in LLM RL rollouts.

The data path (``rollouts``, ``tree``, ``stats``, ``packing``, ``layout``, ``shards``) needs only numpy and
pyarrow; torch is imported only by ``treepack.train`` and ``treepack.kernels``.
"""

__version__ = "0.1.0"
