"""``treepack.sizes.parse_size``: token counts (and shard bytes) with k/K/M/G, never a unit "b"."""

from __future__ import annotations

import pytest

from treepack.errors import TreepackError
from treepack.sizes import parse_size


@pytest.mark.parametrize("text,value", [
    ("60k", 60_000), ("64K", 65_536), ("1m", 1_000_000), ("1M", 2**20), ("2g", 2 * 10**9), ("1G", 2**30),
    ("65536", 65_536), (" 1.5k ", 1_500), ("0.5K", 512), (4096, 4096),
])
def test_counts(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["40Gb", "40GB", "40GiB", "1Mb", "60kb", "64KB", "1.5k tokens"])
def test_a_unit_after_the_prefix_is_refused(text):
    """Sizes here count tokens (or bytes of a shard with K/M/G): "40Gb" (gigabits, in common usage) and "40GB"
    alike are not sizes, said in one line, never read as 40 G."""
    with pytest.raises(TreepackError) as info:
        parse_size(text, what="--capacity")
    assert str(info.value) == f"invalid --capacity {text!r}: expected an integer or a number with k/K/M/G, e.g. 60k"
