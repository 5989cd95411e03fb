"""``[train.dfs] keep_tokens`` takes the size forms of its sibling ``block_size`` (exact messages)."""

from __future__ import annotations

import pytest

from treepack.errors import ConfigError
from treepack.train.config import DfsConfig, TrainConfig, parse_config, parse_dfs_keep

BASE = '[data]\nshards = "p"\n[train]\nmode = "dfs"\n[train.dfs]\n'


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ('"4096"', 4096), ('"8k"', 8000), ('"8K"', 8192),
                                          ('"1M"', 1048576), ('"1.5k"', 1500), ("0", 0), ('"0"', 0), ('"0k"', 0)])
def test_dfs_keep_tokens_takes_sizes(text, tokens):
    keep = parse_config(BASE + f"keep_tokens = {text}\n").train.dfs.keep_tokens
    assert keep == tokens and type(keep) is int  # as the modes take it
    assert parse_config(BASE).train.dfs.keep_tokens == 0


def test_dfs_keep_tokens_in_python():
    assert DfsConfig(keep_tokens="8K").keep_tokens == 8192
    assert TrainConfig(dfs=DfsConfig(keep_tokens=300)).dfs.keep_tokens == 300
    assert parse_dfs_keep(" 2K ", "--dfs-keep-tokens") == 2048
    with pytest.raises(ConfigError, match=r"^train.dfs.keep_tokens must be >= 0, got -5$"):
        DfsConfig(keep_tokens=-5)


def test_dfs_block_size_in_python_reads_as_in_toml():
    assert DfsConfig(block_size=8192) == DfsConfig(block_size="8192") and DfsConfig(block_size=8192).block == 8192
    assert parse_config(BASE + "block_size = 8192\n").train.dfs == DfsConfig(block_size=8192)


KEEP = 'must be a number of tokens such as 4096 or "4K" (0: off)'


@pytest.mark.parametrize("text, error", [
    ("-1", "must be >= 0, got -1"),
    ('"-1"', "must be >= 0, got -1"),
    ('"-4k"', f"{KEEP}, got '-4k'"),
    ('"big"', f"{KEEP}, got 'big'"),
    ('"1.5"', f"{KEEP}, got '1.5'"),
    ('"auto"', f"{KEEP}, got 'auto'"),
    ("1.5", 'must be a size such as 4096 or "4K", got 1.5'),
    ("true", 'must be a size such as 4096 or "4K", got true'),
])
def test_dfs_keep_tokens_errors(text, error):
    with pytest.raises(ConfigError) as exc:
        parse_config(BASE + f"keep_tokens = {text}\n")
    assert str(exc.value) == f"config.toml: train.dfs.keep_tokens {error}"


def test_dfs_keep_tokens_errors_read_as_dfs_block_sizes():
    """The same forms refused in the same words as the sibling key's (less its "auto" and "unlimited")."""
    for key, words in (("block_size", 'must be a number of tokens such as 8192 or "8K", 0 (unlimited) or "auto"'),
                       ("keep_tokens", KEEP)):
        with pytest.raises(ConfigError) as exc:
            parse_config(BASE + f'{key} = "big"\n')
        assert str(exc.value) == f"config.toml: train.dfs.{key} {words}, got 'big'"
