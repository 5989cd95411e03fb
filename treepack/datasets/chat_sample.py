"""The bundled chat sample and the small tokenizer the demo renders it with.

``treepack/datasets/samples/tau_bench_chats.json.gz`` is the first conversations of a tau-bench results file, byte for
byte as JSON (the array form ``treepack tokenize`` reads). ``treepack/datasets/samples/chat_tokenizer/`` is a byte-level
BPE trained on that sample's own text (4,096 tokens: small enough to commit, ~200 kB) with Qwen3's special
tokens and Qwen3's chat template, so the demo shows Qwen3's drift (the empty ``<think>`` block of the last
turn) without the 11 MB Qwen3 tokenizer. Token ids are not Qwen3's: use your model's tokenizer directory for
real data. Regenerate with::

    python -m treepack.datasets.chat_sample ../shared/data/raw/tau_bench_grok3_retail/<file>.json \\
        ../shared/data/tokenizer/qwen3 treepack/datasets/samples
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

N_CONVERSATIONS = 8
VOCAB_SIZE = 4096
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")  # Qwen2/3's pre-tokenizer split


def write_sample(results: Path, out: Path, n: int = N_CONVERSATIONS) -> list[dict]:
    """The first ``n`` conversations of a tau-bench results file as ``out`` (.json.gz, fixed gzip mtime)."""
    data = json.loads(Path(results).read_text(encoding="utf-8"))[:n]
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8"))
    return data


def _texts(data: list[dict]):
    for conv in data:
        for m in conv["traj"]:
            if m.get("content"):
                yield m["content"]
            for call in m.get("tool_calls") or []:
                yield json.dumps(call["function"])


def train_tokenizer(data: list[dict], qwen3: Path, out: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """A byte-level BPE on the sample's text with Qwen3's added tokens, special-token flags and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    qwen_json = json.loads((Path(qwen3) / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((Path(qwen3) / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_texts(data), trainer=trainer)
    added = qwen_json["added_tokens"]
    tok.add_special_tokens([t["content"] for t in added if t["special"]])
    tok.add_tokens([t["content"] for t in added if not t["special"]])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    keep = ("chat_template", "eos_token", "pad_token", "bos_token", "add_bos_token", "model_max_length")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **{k: config[k] for k in keep if k in config}}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit("usage: python -m treepack.datasets.chat_sample TAU_BENCH_RESULTS.json QWEN3_DIR OUT_DIR")
    results, qwen3, out = map(Path, argv)
    out.mkdir(parents=True, exist_ok=True)
    data = write_sample(results, out / "tau_bench_chats.json.gz")
    train_tokenizer(data, qwen3, out / "chat_tokenizer")


if __name__ == "__main__":
    main(sys.argv[1:])
