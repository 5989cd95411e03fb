"""``train.memory_limit`` (`treepack.train.memory_limit`): the forms it takes, its refusals, the start line, the
one-line out-of-memory error, and on a GPU the allocator's cap and dfs's auto block inside it."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import run as cli
from test_train_cli import write_config

from treepack.errors import ConfigError, TreepackError
from treepack.train.memory_limit import (
    MemoryLimit,
    OutOfMemory,
    applied_limit,
    capped,
    describe_memory_limit,
    out_of_memory_message,
    parse_memory_limit,
    state_bytes,
)
from treepack.train.model import Decoder, ModelArgs

ARGS = ModelArgs.for_family("qwen3", vocab_size=1000, hidden_size=64, intermediate_size=160, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("text,limit,total,expected", [
    ("40GB", MemoryLimit(40e9), 80 * 2**30, 40_000_000_000),
    ("40GiB", MemoryLimit(40 * 2**30), 80 * 2**30, 40 * 2**30),
    (" 1.5 gib ", MemoryLimit(1.5 * 2**30), 80 * 2**30, 3 * 2**29),
    ("512MiB", MemoryLimit(2**29), 80 * 2**30, 2**29),
    ("50%", MemoryLimit(50, percent=True), 80 * 2**30, 40 * 2**30),
    ("12.5%", MemoryLimit(12.5, percent=True), 80_000_000_000, 10_000_000_000),
    ("100%", MemoryLimit(100, percent=True), 123, 123),
    ("40gb", MemoryLimit(40e9), 80 * 2**30, 40_000_000_000),  # all lower-case: any case, as before
])
def test_forms(text, limit, total, expected):
    parsed = parse_memory_limit(text)
    assert (parsed.amount, parsed.percent, parsed.text) == (limit.amount, limit.percent, text.strip())
    assert parsed.bytes_of(total) == expected


@pytest.mark.parametrize("text", ["", "  "])
def test_empty_is_no_limit(text):
    assert parse_memory_limit(text) is None


@pytest.mark.parametrize("text,message", [
    ("40", ('train.memory_limit must be a size such as "40GB" or "40GiB", or a share of the GPU such as "50%" '
           '("" for no limit), got \'40\'')),
    ("lots", ('train.memory_limit must be a size such as "40GB" or "40GiB", or a share of the GPU such as "50%" '
             '("" for no limit), got \'lots\'')),
    ("-4GB", ('train.memory_limit must be a size such as "40GB" or "40GiB", or a share of the GPU such as "50%" '
             '("" for no limit), got \'-4GB\'')),
    ("0GB", "train.memory_limit must be positive, got '0GB'"),
    ("\u0664\u0660GB", ('train.memory_limit must be a size such as "40GB" or "40GiB", or a share of the GPU such as '
                 '"50%" ("" for no limit), got \'\u0664\u0660GB\'')),  # digits in another script
    ("0%", "train.memory_limit must be a share in (0%, 100%], got '0%'"),
    ("150%", "train.memory_limit must be a share in (0%, 100%], got '150%'"),
    # a capital prefix and a lower-case "b" is how bits are written (a 40Gb link): refused, with the bytes forms
    ("40Gb", 'train.memory_limit must be in bytes, got \'40Gb\' (a lower-case "b" is a bit): write "40GB" or "40GiB"'),
    ("512Mb", ('train.memory_limit must be in bytes, got \'512Mb\' (a lower-case "b" is a bit): write "512MB" or '
               '"512MiB"')),
    ("1.5Tb", ('train.memory_limit must be in bytes, got \'1.5Tb\' (a lower-case "b" is a bit): write "1.5TB" or '
               '"1.5TiB"')),
    ("40Gib", ('train.memory_limit must be in bytes, got \'40Gib\' (a lower-case "b" is a bit): write "40GB" or '
               '"40GiB"')),
    ("40kb", ('train.memory_limit must be a size such as "40GB" or "40GiB", or a share of the GPU such as "50%" '
              '("" for no limit), got \'40kb\'')),
])
def test_refusals(text, message):
    with pytest.raises(ConfigError) as info:
        parse_memory_limit(text)
    assert str(info.value) == message


def test_a_bad_limit_in_a_config_is_one_line(tmp_path):
    path = write_config(tmp_path, extra='memory_limit = "half"\n')
    r = cli("train", path)
    assert r.code == 1 and r.out == ""
    assert r.err.strip().splitlines() == [
        (f'Error: {path}: train.memory_limit must be a size such as "40GB" or "40GiB", or a share of the GPU '
        'such as "50%" ("" for no limit), got \'half\'')]


def test_off_cuda_it_is_said_and_ignored(tmp_path):
    model = Decoder.random_init(ARGS, seed=0, dtype=torch.float32)
    cpu = torch.device("cpu")
    with capped(MemoryLimit(1e9, text="1GB"), cpu, "tree"):
        assert applied_limit(cpu) is None
        assert describe_memory_limit(MemoryLimit(1e9, text="1GB"), model, cpu, torch.float32) == (
            "train.memory_limit applies to CUDA GPUs: ignored on cpu")
    assert describe_memory_limit(None, model, cpu, torch.float32) is None
    r = cli("train", write_config(tmp_path, steps=1, extra='memory_limit = "1GB"\n'))
    assert r.code == 0, r.err
    assert r.out.splitlines().count("train.memory_limit applies to CUDA GPUs: ignored on cpu") == 1


def test_state_counts_weights_grads_moments_and_working_copies():
    model = Decoder.random_init(ARGS, seed=0, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert state_bytes(model, torch.float32) == 16 * n
    assert state_bytes(model, torch.bfloat16) == 16 * n + 2 * matrices


TORCH_OOM = ("CUDA out of memory. Tried to allocate 2.30 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use.")


@pytest.mark.parametrize("mode,remedy", [
    ("tree", ('lower data.capacity (a pack is the memory bound), use mode = "dfs" (its calls follow the memory), or '
             "turn on train.activation_checkpointing")),
    ("dense-leaf", "lower train.micro_batch_tokens, or turn on train.activation_checkpointing"),
    ("dfs", ('set train.dfs.block_size = "auto" or a smaller block, lower train.logits_chunk, or turn on '
            "train.activation_checkpointing")),
])
def test_out_of_memory_is_one_line_with_what_lowers_the_peak(mode, remedy):
    assert out_of_memory_message(RuntimeError(TORCH_OOM), mode) == (
        f"out of GPU memory (tried to allocate 2.30 GiB): {remedy}")
    assert out_of_memory_message(RuntimeError("odd"), mode) == f"out of GPU memory: {remedy}"


def test_out_of_memory_in_a_run_is_still_torchs_and_one_line(tmp_path, monkeypatch):
    """`train` turns torch's error into `OutOfMemory`: a ``torch.OutOfMemoryError`` for callers that catch that,
    and an error line, not a traceback, in the CLI."""
    from treepack.train import loop

    def oom(*args):
        raise torch.OutOfMemoryError(TORCH_OOM)

    monkeypatch.setattr(loop, "_train", oom)
    path = write_config(tmp_path, mode="dense")
    from treepack.train.config import load_config

    with pytest.raises(torch.OutOfMemoryError) as info:
        loop.train(load_config(path))
    assert isinstance(info.value, OutOfMemory) and isinstance(info.value, TreepackError)
    r = cli("train", path)
    assert r.code == 1 and "Traceback" not in r.err
    assert r.err.strip().splitlines() == [
        ("Error: out of GPU memory (tried to allocate 2.30 GiB): lower train.micro_batch_tokens, or turn on "
        "train.activation_checkpointing")]


# --------------------------------------------------------------------------------------------------
# GPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def gpu_model():
    return Decoder.random_init(ARGS, seed=0, dtype=torch.float32, device="cuda")


@pytest.mark.gpu
@cuda
def test_the_allocator_is_capped_for_the_run_and_restored_after(gpu_model):
    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.get_per_process_memory_fraction(0)
    with (pytest.raises(OutOfMemory, match=r"^out of GPU memory \(tried to allocate .*\): lower data.capacity"),
          capped(MemoryLimit(2e9, text="2GB"), dev, "tree")):
        assert applied_limit(dev) == 2_000_000_000
        line = describe_memory_limit(MemoryLimit(2e9, text="2GB"), gpu_model, dev, torch.bfloat16)
        assert line.startswith(f"memory: this run may take 2.0 of the GPU's {total / 1e9:.1f} GB (train.memory_limit)")
        from treepack.train.modes.dfs_memory import AUTO_FRACTION, available_bytes

        assert available_bytes(dev) <= AUTO_FRACTION * 2e9
        torch.cuda.empty_cache()
        torch.empty(int(2.5e9), dtype=torch.uint8, device=dev)  # torch's error, made OutOfMemory by `capped`
    assert applied_limit(dev) is None and torch.cuda.get_per_process_memory_fraction(0) == before
    x = torch.empty(int(2.5e9), dtype=torch.uint8, device=dev)  # the cap is gone
    del x
    torch.cuda.empty_cache()


@pytest.mark.gpu
@cuda
def test_a_limit_below_the_state_or_above_the_gpu_is_refused(gpu_model):
    dev = torch.device("cuda")
    state = state_bytes(gpu_model, torch.bfloat16)
    with (capped(MemoryLimit(state - 1, text="tiny"), dev, "tree"),
          pytest.raises(ConfigError, match=r'train.memory_limit = "tiny" \(.* GB\) cannot hold the model')):
        describe_memory_limit(MemoryLimit(state - 1, text="tiny"), gpu_model, dev, torch.bfloat16)
    with (pytest.raises(ConfigError, match=r'train.memory_limit = "1PB" is more than this GPU has'),
          capped(MemoryLimit(10**15, text="1PB"), dev, "tree")):
        pass
    assert applied_limit(dev) is None
