"""Shared helpers for the dflash pipeline tests: one tiny tokenizer and corpus per test process, tiny configs.

The tiny BPE is trained once (cached on disk by corpus fingerprint), so every test module reuses it in milliseconds.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

from dflash.config import DataConfig, RunConfig, config_from_dict
from dflash.data import Document, TokenizedCorpus, TokenizerAdapter, load_tokenizer, read_documents, tokenize

# Small enough that tokenizer training and a few target forwards take seconds on 2 shared cores.
TEST_CHARS = 200_000
TEST_VOCAB = 512


def tokenizer_cache() -> Path:
    """Process-shared cache dir (content-addressed file names, so a stale entry can never be picked up)."""
    p = Path(os.environ.get("DFLASH_TEST_CACHE", Path(tempfile.gettempdir()) / "dflash-test-cache"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def data_cfg(**overrides: Any) -> DataConfig:
    base: dict[str, Any] = {"max_chars": TEST_CHARS, "vocab_size": TEST_VOCAB, "max_len": 64, "min_len": 8,
                            "token_budget": 256, "num_buckets": 4, "reservoir": 3}
    base.update(overrides)
    return DataConfig(**base)


@functools.lru_cache(maxsize=4)
def tiny_corpus(max_len: int = 64) -> tuple[list[Document], TokenizerAdapter, TokenizedCorpus]:
    cfg = data_cfg(max_len=max_len)
    docs = read_documents(cfg)
    tok = load_tokenizer(cfg, docs, tokenizer_cache())
    return docs, tok, tokenize(docs, tok)


def tiny_run_yaml(**sections: dict[str, Any]) -> dict[str, Any]:
    """A run config small enough for a test: a 4-layer tiny target, 1 drafter layer, 256-token buffers."""
    cfg: dict[str, Any] = {
        "target": {"arch": {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "initializer_range": 0.25},
                   "seed": 0},
        "drafter": {"num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "block_size": 4, "num_anchors": 32},
        "data": {"max_chars": TEST_CHARS, "vocab_size": TEST_VOCAB, "max_len": 48, "min_len": 8,
                 "token_budget": 256, "num_buckets": 4, "reservoir": 3,
                 "tokenizer_cache": str(tokenizer_cache())},
        "train": {"lr": 1e-2, "warmup_frac": 0.1, "max_steps": 6, "checkpoint_every": 3, "keep_last": 2,
                  "heartbeat_s": 0.5, "seed": 0, "compile": "false"},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def run_config(**sections: dict[str, Any]) -> RunConfig:
    return config_from_dict(tiny_run_yaml(**sections), "<test>")
