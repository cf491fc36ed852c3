"""Tests of the data path: corpus reading, tiny BPE, chat loss masks, packing and the on-disk epoch schedule.

The schedule must be a pure function of the seed and continue exactly where a resumed run left off.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from dflash_fixtures import data_cfg, tiny_corpus, tokenizer_cache

from dflash.data import (
    DataError,
    buffer_arrays,
    buffer_rows,
    build_schedule,
    load_or_build_schedule,
    load_tokenizer,
    make_pieces,
    pack_epoch,
    read_documents,
    tokenize,
)


def test_embedded_corpus_is_real_python_source_and_tokenizer_round_trips() -> None:
    docs, tok, corpus = tiny_corpus()
    assert sum(len(d.text or "") for d in docs) <= data_cfg().max_chars
    assert any("def " in (d.text or "") for d in docs)
    sample = docs[0].text[:300]
    assert tok.decode(tok.encode(sample)) == sample  # byte-level BPE: lossless
    assert tok.mask_token_id is not None and tok.mask_token_id < tok.vocab_size
    assert corpus.ids[0][-1].item() == tok.eos_id and bool(corpus.loss_mask[0].all())


def test_tokenizer_is_cached_by_corpus(tmp_path: Path) -> None:
    docs, tok, _ = tiny_corpus()
    again = load_tokenizer(data_cfg(), docs, tokenizer_cache())
    assert again.source == tok.source and again.encode("import os") == tok.encode("import os")
    other = load_tokenizer(data_cfg(), docs[:2], tmp_path)  # other corpus -> other cache entry
    assert other.source != tok.source


def test_chat_loss_mask_covers_assistant_tokens_only(tmp_path: Path) -> None:
    _, tok, _ = tiny_corpus()
    f = tmp_path / "chat.jsonl"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"},
            {"role": "assistant", "content": "four"}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "six"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"text": "plain text"}) + "\n")
    docs = read_documents(data_cfg(paths=[str(f)]))
    corpus = tokenize(docs, tok)
    ids, mask = corpus.ids[0].tolist(), corpus.loss_mask[0].tolist()
    supervised = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert supervised == "four<|end|>six<|end|>"
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if not m]).count("<|user|>") == 2
    assert bool(corpus.loss_mask[1].all())  # plain text: every token supervised


@pytest.mark.parametrize(("content", "needle"), [
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ("{not json", "not valid JSON"),
    ('{"prompt": "x"}', "expected a 'text', 'messages' or 'conversations' key"),
])
def test_bad_data_names_file_and_line(tmp_path: Path, content: str, needle: str) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n' + content + "\n")
    with pytest.raises(DataError) as exc:
        read_documents(data_cfg(paths=[str(f)]))
    assert f"{f}:2:" in str(exc.value) and needle in str(exc.value)


def test_missing_data_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope.txt: data file does not exist"):
        read_documents(data_cfg(paths=[str(tmp_path / "nope.txt")]))


def test_pieces_cover_documents_and_respect_max_len() -> None:
    pieces = make_pieces([5, 130, 64, 1], max_len=64, min_len=2)
    assert pieces == [(0, 0, 5), (1, 0, 64), (1, 64, 64), (1, 128, 2), (2, 0, 64)]


def test_packing_uses_every_piece_once_within_budget() -> None:
    _, _, corpus = tiny_corpus()
    pieces = make_pieces(corpus.lengths(), 64, 8)
    bufs = pack_epoch(pieces, token_budget=256, max_len=64, num_buckets=4, seed=3, epoch=0)
    flat = [p for b in bufs for p in b]
    assert Counter(flat) == Counter(pieces)
    assert all(sum(p[2] for p in b) <= 256 for b in bufs)
    fill = sum(p[2] for p in flat) / (256 * len(bufs))
    assert fill > 0.9, f"packing wastes too much: {fill:.2%} full"
    # length bucketing: most buffers hold pieces of one bucket
    spread = [max(p[2] for p in b) - min(p[2] for p in b) for b in bufs]
    assert sorted(spread)[len(spread) // 2] < 32


def test_schedule_is_deterministic_from_seed_and_differs_across_seeds_and_epochs() -> None:
    _, _, corpus = tiny_corpus()
    cfg = data_cfg()
    a = build_schedule(corpus, cfg, seed=7, epochs=2)
    b = build_schedule(corpus, cfg, seed=7, epochs=2)
    c = build_schedule(corpus, cfg, seed=8, epochs=1)
    assert a.epochs == b.epochs
    assert a.epochs[0] != c.epochs[0]
    assert a.epochs[0] != a.epochs[1]  # each epoch reshuffles


def test_schedule_on_disk_is_reused_extended_and_guarded(tmp_path: Path) -> None:
    _, _, corpus = tiny_corpus()
    cfg = data_cfg()
    path = tmp_path / "schedule.json"
    first = load_or_build_schedule(corpus, cfg, 5, 1, path)
    mtime = path.stat().st_mtime_ns
    assert load_or_build_schedule(corpus, cfg, 5, 1, path).epochs == first.epochs
    assert path.stat().st_mtime_ns == mtime  # reused, not rewritten
    longer = load_or_build_schedule(corpus, cfg, 5, 2, path)  # a longer run extends it deterministically
    assert longer.epochs[0] == first.epochs[0]
    assert longer.epochs[1] == build_schedule(corpus, cfg, 5, 2).epochs[1]
    with pytest.raises(DataError, match="train.seed 5 on disk, 6 now"):
        load_or_build_schedule(corpus, cfg, 6, 1, path)
    path.write_text("{trunc")
    with pytest.raises(DataError, match="unreadable schedule"):
        load_or_build_schedule(corpus, cfg, 5, 1, path)


def test_buffer_views_agree() -> None:
    _, _, corpus = tiny_corpus()
    bufs = build_schedule(corpus, data_cfg(), 0, 1).epochs[0]
    pieces = bufs[0]
    arr = buffer_arrays(corpus, pieces, 256)
    ids, att = buffer_rows(corpus, pieces, pad_id=0)
    assert arr["input_ids"].shape == (256,)
    real = int((arr["doc_ids"] >= 0).sum())
    assert real == sum(p[2] for p in pieces) == int(att.sum())
    assert arr["input_ids"][:real].tolist() == ids[att.bool()].tolist()
    d, s, n = pieces[0]
    assert arr["input_ids"][:n].tolist() == corpus.ids[d][s:s + n].tolist()
    assert arr["position_ids"][:n].tolist() == list(range(n))


def test_hf_tokenizer_dir_with_chat_template_masks_assistant_content(tmp_path: Path) -> None:
    """A real Hugging Face tokenizer directory (our BPE saved through transformers, with a jinja chat template)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    _, tok, _ = tiny_corpus()
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tok.source), eos_token="<|endoftext|>",
                                 pad_token="<|pad|>", mask_token="<|mask|>")
    hf.chat_template = template
    hf.save_pretrained(str(tmp_path / "hf"))
    f = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    cfg = data_cfg(paths=[str(f)], tokenizer=str(tmp_path / "hf"))
    docs = read_documents(cfg)
    adapter = load_tokenizer(cfg, docs, tmp_path / "unused")
    assert adapter.mask_token_id == tok.mask_token_id and adapter.eos_id == tok.eos_id
    corpus = tokenize(docs, adapter)
    ids, mask = corpus.ids[0].tolist(), corpus.loss_mask[0].tolist()
    assert adapter.decode(ids) == "<|user|>hi there<|end|><|assistant|>hello<|end|><|user|>bye<|end|><|assistant|>ciao<|end|>"
    assert adapter.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "hello<|end|>ciao<|end|>"
    with pytest.raises(DataError, match="must be a local tokenizer directory"):
        load_tokenizer(data_cfg(tokenizer=str(tmp_path / "nope")), docs, tmp_path)


def test_directory_of_text_files_and_format_filter(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("first file")
    (tmp_path / "c.jsonl").write_text('{"text": "json text"}\n')
    (tmp_path / "ignored.md").write_text("not data")
    docs = read_documents(data_cfg(paths=[str(tmp_path)]))
    assert [d.text for d in docs] == ["second file", "json text", "first file"]  # sorted by path
    with pytest.raises(DataError, match="expected a 'messages' key"):
        read_documents(data_cfg(paths=[str(tmp_path / "c.jsonl")], format="chat"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl files"):
        read_documents(data_cfg(paths=[str(empty)]))


def test_corpus_fingerprint_follows_the_tokenizer_content_not_its_path(tmp_path: Path) -> None:
    """A run dir that is moved, copied or named by another path holds the same tokenizer: the schedule must match."""
    import shutil

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from dflash.data import TokenizerAdapter, train_tiny_tokenizer

    docs, tok, corpus = tiny_corpus()
    copies = []
    for name in ("a", "b"):
        p = tmp_path / name / "tiny.json"
        p.parent.mkdir()
        shutil.copyfile(tok.source, p)
        copies.append(TokenizerAdapter(tiny=Tokenizer.from_file(str(p)), source=str(p)))
    assert tokenize(docs, copies[0]).fingerprint == tokenize(docs, copies[1]).fingerprint == corpus.fingerprint
    other = TokenizerAdapter(tiny=train_tiny_tokenizer(docs[:3], 300), source=copies[0].source)  # same path
    assert tokenize(docs, other).fingerprint != corpus.fingerprint

    # A Hugging Face tokenizer directory, copied: same content, same fingerprint.
    hf_dir = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tok.source), eos_token="<|endoftext|>",
                            pad_token="<|pad|>").save_pretrained(hf_dir)
    shutil.copytree(hf_dir, tmp_path / "hf-copy")
    a = load_tokenizer(data_cfg(tokenizer=str(hf_dir)), docs, tmp_path / "unused")
    b = load_tokenizer(data_cfg(tokenizer=str(tmp_path / "hf-copy")), docs, tmp_path / "unused")
    assert a.source != b.source and tokenize(docs[:5], a).fingerprint == tokenize(docs[:5], b).fingerprint
    assert not (tmp_path / "unused").exists()


def test_schedule_mismatch_says_what_differs_and_how_to_resume(tmp_path: Path) -> None:
    docs, tok, corpus = tiny_corpus()
    path = tmp_path / "schedule.json"
    load_or_build_schedule(corpus, data_cfg(), 0, 1, path)
    fewer = tokenize(docs[:-1], tok)  # the corpus changed
    with pytest.raises(DataError) as exc:
        load_or_build_schedule(fewer, data_cfg(num_buckets=2), 0, 1, path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: schedule was made for other data/settings: ")
    assert f"the corpus or tokenizer content (fingerprint {corpus.fingerprint[:12]} on disk, " \
           f"{fewer.fingerprint[:12]} now)" in msg
    assert "data.num_buckets 4 on disk, 2 now" in msg and "restore the original data" in msg
    assert "\n" not in msg
