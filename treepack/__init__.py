"""treepack: find and exploit shared prefixes in LLM RL rollouts.

The package follows the data flow, each stage importing only the ones before it (docs/design.md §2):
``io`` (read rollouts), ``chat`` (chat transcripts -> token records) and ``datasets`` (synthetic rollouts) <
``tree`` / ``stats`` (the prefix tree and its numbers) < ``pack`` (packs, layout, shards) and ``kernels`` <
``train`` / ``hf`` (torch) < ``viz`` (figures, report) < ``cli``. Everything up to ``pack`` needs only numpy
and pyarrow; torch is imported only by ``treepack.train``, ``treepack.hf`` and ``treepack.kernels``.
"""

__version__ = "0.1.0"
