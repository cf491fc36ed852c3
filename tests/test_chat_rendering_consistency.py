"""`dflash regen` and `dflash eval` render chats exactly as training does (docs/data.md): the record's tools, its tool
calls in the template's form, and `data.thinking`'s switch (Qwen3's enable_thinking=False under drop). Otherwise the
target answers prompts the drafter never sees when serving (thinking mode for a non-thinking drafter, no tools), and
held-out metrics are measured on other prompts than the training ones."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from dflash_fixtures import data_cfg, run_config
from test_data_rendering import PLAIN, QWEN3_SHAPED, TOOL_CHAT, TOOLS, _hf_tokenizer, _write_jsonl

from dflash.data import DataError, Document, TokenizerAdapter, load_tokenizer, read_documents, tokenize
from dflash.eval import Loaded, load_tokenizer_for, prompts_from_documents, read_prompts
from dflash.regen import RegenSettings, corpus_prompts, regen, regen_key_fields

ONE_TURN = [{"role": "user", "content": "weather in Oslo?"}, {"role": "assistant", "content": "Cold."}]


def _docs(tmp_path: Path, records: list[dict[str, Any]], **cfg: Any) -> tuple[list[Document], TokenizerAdapter]:
    f = _write_jsonl(tmp_path / f"c{len(list(tmp_path.glob('c*.jsonl')))}.jsonl", records)
    dc = data_cfg(paths=[str(f)], **cfg)
    docs = read_documents(dc)
    return docs, load_tokenizer(dc, docs, tmp_path / "tokcache")


def _reply_prefix(ids: list[int], mask: list[bool]) -> list[int]:
    """The tokens before the last supervised run: the context training gives the chat's final reply."""
    end = max(j for j, m in enumerate(mask) if m)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return ids[:start]


def _training_prefix(tok: TokenizerAdapter, doc: Document, turn: int) -> list[int]:
    """Training's rendering of the chat up to and including assistant turn `turn`: what precedes that reply."""
    ids, mask = tok.encode_chat((doc.messages or [])[: turn + 1], doc.tools)
    return _reply_prefix(ids, mask)


CASES = [("qwen3", "drop"), ("qwen3", "keep"), ("plain", "drop"), ("tiny", "keep")]


@pytest.mark.parametrize(("template", "thinking"), CASES)
def test_regen_prompts_equal_the_training_prompt_prefix_with_tools_and_thinking_switch(
        tmp_path: Path, template: str, thinking: str) -> None:
    extra = {} if template == "tiny" else \
        {"tokenizer": _hf_tokenizer(tmp_path, QWEN3_SHAPED if template == "qwen3" else PLAIN)}
    docs, tok = _docs(tmp_path, [{"messages": TOOL_CHAT, "tools": TOOLS}], thinking=thinking, **extra)
    prompts = corpus_prompts(docs, tok, 8, 64)
    assert [p.id for p in prompts] == ["0:turn1", "0:turn3"]
    for p in prompts:
        turn = int(p.id.split("turn")[1])
        assert p.ids == _training_prefix(tok, docs[0], turn), (p.id, tok.decode(p.ids))
        text = tok.decode(p.ids)
        assert "get_weather" in text and "Weather of a city" in text  # the record's tools are in the prompt
    # The last reply's prompt is also the exact prefix of the whole record as training tokenizes it.
    corpus = tokenize(docs, tok)
    assert prompts[-1].ids == _reply_prefix(corpus.ids[0].tolist(), corpus.loss_mask[0].tolist())
    last = tok.decode(prompts[-1].ids)
    if template == "qwen3":
        scaffold = last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert scaffold == (thinking == "drop")  # non-thinking prompt only under drop
        assert last.endswith("<|im_start|>assistant\n") or scaffold
    if template == "plain":  # a template without tool calls: the call reaches it as text, as training writes it
        assert '<tool_call>\n{"name": "get_weather"' in last


def test_regen_records_begin_with_the_training_prompt_and_refuse_another_rendering(tmp_path: Path) -> None:
    """A real regen (tiny random target) writes the training prompt as each record's unsupervised head; rerunning
    into the same --out with data.thinking changed is refused (its prompts would differ), naming the rendering."""
    hf = _hf_tokenizer(tmp_path, QWEN3_SHAPED)
    f = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": TOOL_CHAT, "tools": TOOLS}])
    cfg = run_config(data={"paths": [str(f)], "tokenizer": hf, "thinking": "drop", "max_len": 256})
    docs = read_documents(cfg.data)
    tok = load_tokenizer(cfg.data, docs, tmp_path / "tokcache")
    out = tmp_path / "regen"
    settings = RegenSettings(max_new_tokens=3, prompt_tokens=8)
    summary = regen(cfg, docs, out, settings, log=lambda _m: None)
    assert summary["written"] == 2 and summary["complete"]
    records = [json.loads(line) for line in (out / "regen.jsonl").read_text().splitlines()]
    for rec in records:
        turn = int(rec["id"].split("turn")[1])
        head = rec["input_ids"][: rec["prompt_tokens"]]
        assert head == _training_prefix(tok, docs[0], turn)
        assert rec["loss_mask"][: rec["prompt_tokens"]] == [0] * rec["prompt_tokens"]
    assert json.loads((out / "regen.json").read_text())["rendering"] == {"tools": "rendered", "thinking": "drop"}
    keep = run_config(data={"paths": [str(f)], "tokenizer": hf, "thinking": "keep", "max_len": 256})
    with pytest.raises(DataError, match=r"regen\.json: records in .* were made with another chat rendering "
                                        r"\(tools, data\.thinking\); use another --out"):
        regen(keep, read_documents(keep.data), out, settings, log=lambda _m: None)


@pytest.mark.parametrize("thinking", ["drop", "keep"])
def test_eval_heldout_prompt_equals_the_training_prompt_of_the_same_record(tmp_path: Path, thinking: str) -> None:
    hf = _hf_tokenizer(tmp_path, QWEN3_SHAPED)
    docs, tok = _docs(tmp_path, [{"messages": ONE_TURN, "tools": TOOLS}, {"messages": TOOL_CHAT, "tools": TOOLS}],
                      tokenizer=hf, thinking=thinking)
    corpus = tokenize(docs, tok)
    held = prompts_from_documents(docs, tok, 8, 64, 10)
    assert held[0] == _reply_prefix(corpus.ids[0].tolist(), corpus.loss_mask[0].tolist())
    # A chat whose first reply is not its last: the prompt that reply gets (the one regen sends for it).
    assert held[1] == _training_prefix(tok, docs[1], 1) == corpus_prompts(docs[1:], tok, 8, 64)[0].ids
    # A --prompts file with the same chat and tools renders the same prompt.
    pf = _write_jsonl(tmp_path / "prompts.jsonl", [{"messages": ONE_TURN[:1], "tools": TOOLS}])
    assert read_prompts(pf, tok) == [held[0]]


def test_eval_tokenizer_from_the_target_dir_renders_with_the_runs_thinking(tmp_path: Path) -> None:
    """Without the run's own tokenizer, eval loads the target directory's, but still with the run's data.thinking:
    under drop, Qwen3's empty think block is the prompt's (as in training), not a reply eval would score."""
    hf = _hf_tokenizer(tmp_path, QWEN3_SHAPED)
    docs, train_tok = _docs(tmp_path, [{"messages": ONE_TURN, "tools": TOOLS}], tokenizer=hf, thinking="drop")
    cfg = run_config(data={"thinking": "drop"})
    loaded = Loaded(drafter=None, tap_layers=[], source="", cfg=cfg, run_dir=None, pipeline=None,  # type: ignore
                    target_meta={})
    tok = load_tokenizer_for(loaded, hf, None)
    assert tok.thinking == "drop" and tok.content_hash == train_tok.content_hash
    assert prompts_from_documents(docs, tok, 8, 64, 1) == prompts_from_documents(docs, train_tok, 8, 64, 1)
    assert tok.decode(prompts_from_documents(docs, tok, 8, 64, 1)[0]).endswith("<think>\n\n</think>\n\n")


def _old_key(cfg: Any, tok: TokenizerAdapter, docs: list[Document], settings: RegenSettings) -> dict[str, Any]:
    """regen's cache-key fields before it rendered chats as training does (the entries already on disk)."""
    from dataclasses import asdict

    from dflash.cache_entry import target_identity
    from dflash.data import corpus_fingerprint
    from dflash.regen import _FORMAT

    return {"format": _FORMAT, "target": target_identity(cfg.target), "tokenizer": tok.content_hash,
            "corpus": corpus_fingerprint(docs), "settings": asdict(settings.resolved(cfg.data.max_len))}


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


@pytest.mark.parametrize("template", ["qwen3", "plain", "tiny", "text"])
def test_regen_cache_key_changes_when_thinking_changes_the_prompts_and_not_otherwise(
        tmp_path: Path, template: str) -> None:
    """Chats without tools or thinking: the key is the old one unless data.thinking: drop changes the prompts (a
    template with a thinking switch); then it differs, so records made in thinking mode are not reused."""
    cfg = run_config()
    settings = RegenSettings()
    extra = {"tokenizer": _hf_tokenizer(tmp_path, QWEN3_SHAPED if template == "qwen3" else PLAIN)} \
        if template in ("qwen3", "plain") else {}
    records = [{"text": "plain text " * 20}] if template == "text" else [{"messages": ONE_TURN}]
    keys, prompts = {}, {}
    for thinking in ("keep", "drop"):
        docs, tok = _docs(tmp_path, records, thinking=thinking, **extra)
        prompts[thinking] = [p.ids for p in corpus_prompts(docs, tok, 2, 64)]
        keys[thinking] = _digest(regen_key_fields(cfg, tok, docs, settings))
        if thinking == "keep" or template != "qwen3":
            assert keys[thinking] == _digest(_old_key(cfg, tok, docs, settings))  # entries on disk keep their name
    assert prompts["keep"] and (prompts["keep"] != prompts["drop"]) == (template == "qwen3")
    assert (keys["keep"] != keys["drop"]) == (template == "qwen3")


def test_regen_cache_key_names_tools_which_change_the_prompts(tmp_path: Path) -> None:
    cfg = run_config()
    hf = _hf_tokenizer(tmp_path, QWEN3_SHAPED)
    docs, tok = _docs(tmp_path, [{"messages": ONE_TURN, "tools": TOOLS}], tokenizer=hf, thinking="keep")
    fields = regen_key_fields(cfg, tok, docs, RegenSettings())
    assert fields["rendering"] == {"tools": "rendered"}
    assert _digest(fields) != _digest(_old_key(cfg, tok, docs, RegenSettings()))
