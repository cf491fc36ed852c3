"""`dflash data inspect` as a real process: what it counts, drops and packs, and the one line bad data gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_fixtures import data_cfg, tiny_corpus

from dflash.data import make_pieces, pack_epoch, read_documents, token_lists
from dflash.data_inspect import summarize

DFLASH = str(Path(sys.executable).with_name("dflash"))


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")}
    return subprocess.run([DFLASH, "data", "inspect", *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)


def _chats(tmp_path: Path) -> Path:
    recs = [{"conversations": [{"from": "human", "value": f"question number {i}, please answer it at length"},
                               {"from": "gpt", "value": f"answer number {i} " * 6}]} for i in range(20)]
    recs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})  # too short
    recs.append({"conversations": [{"from": "human", "value": "a user turn alone, long enough to be kept " * 2}]})
    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return f


def test_inspect_counts_drops_and_shows_the_loss_mask_in_plain_text_on_a_pipe(tmp_path: Path) -> None:
    f = _chats(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target: {{arch: {{num_hidden_layers: 3}}}}\ndata: {{paths: [{f.name}], vocab_size: 300, "
                   "max_len: 32, min_len: 12, token_budget: 128, num_buckets: 2}\n")
    r = _run(tmp_path, "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "documents: 22 (22 chats)" in out
    assert "shorter than data.min_len=12 tokens: 1 document(s)" in out  # the "hi"/"yo" chat
    assert "1 document(s) have no supervised token" in out  # the user turn alone
    assert "buffers (epoch 0, 128 tokens each):" in out
    assert "supervised tokens between [[ and ]]" in out and "[[answer number 0" in out
    assert "\033[" not in out  # not a TTY: no colour codes
    # the JSON form carries the same numbers, and they are the training code's own
    js = json.loads(_run(tmp_path, "--config", str(cfg), "--json").stdout)
    dc = data_cfg(paths=[str(f)], vocab_size=300, max_len=32, min_len=12, token_budget=128, num_buckets=2)
    docs = read_documents(dc)
    from dflash.data import load_tokenizer

    tok = load_tokenizer(dc, docs, tmp_path / "cache" / "tokenizer")
    lists = list(token_lists(docs, tok))
    lengths = [len(i) for i, _ in lists]
    pieces = make_pieces(lengths, 32, 12)
    assert js["tokens"] == sum(lengths) and js["supervised"] == sum(sum(m) for _, m in lists)
    assert js["pieces"] == len(pieces) and js["buffers"] == len(pack_epoch(pieces, 128, 32, 2, 0, 0))
    assert js["dropped"]["shorter than data.min_len=12 tokens"]["documents"] == 1


def test_inspect_a_data_path_with_format_flags(tmp_path: Path) -> None:
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"body": "some plain text " * 20}, {"body": "more plain text " * 30}]))
    r = _run(tmp_path, str(f), "--format", "text", "--text-field", "body")
    assert r.returncode == 0, r.stderr
    assert "documents: 2 (2 text)" in r.stdout and "= 100.0 %" in r.stdout


def test_inspect_bad_record_is_one_line_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"conversations": [{"from": "bot", "value": "x"}]}) + "\n")
    r = _run(tmp_path, str(f))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"dflash: {f}:1: conversations[0].from 'bot' is not one of "
        "human/gpt/system/user/assistant/tool/function_call/observation"]
    r = _run(tmp_path)
    assert r.returncode == 2 and "needs --config CONFIG or DATA" in r.stderr and "Traceback" not in r.stderr


def test_summary_fill_and_drops_follow_the_packing() -> None:
    docs, tok, corpus = tiny_corpus()
    cfg = data_cfg()
    lengths = corpus.lengths()
    sup = [int(m.sum()) for m in corpus.loss_mask]
    s = summarize(docs, lengths, sup, cfg, 0, lambda d, st, n: int(corpus.loss_mask[d][st:st + n].sum()))
    bufs = pack_epoch(make_pieces(lengths, cfg.max_len, cfg.min_len), cfg.token_budget, cfg.max_len,
                      cfg.num_buckets, 0, 0)
    assert s.buffers == len(bufs)
    assert abs(s.fill_mean - sum(sum(p[2] for p in b) for b in bufs) / (len(bufs) * cfg.token_budget)) < 1e-9
    assert s.piece_tokens + sum(r["tokens"] for r in s.dropped.values()) == s.tokens == sum(lengths)
    assert sum(c for _, c in s.length_bins) == len(docs)


def test_inspect_of_a_config_never_imports_torch_or_transformers(tmp_path: Path) -> None:
    """It answers in about a second: what it reads is the data section, the corpus and the tokenizer."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "dflash", "data", "inspect", "--config",
                        str(repo / "configs" / "tiny.yaml")], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pieces:" in r.stdout and "buffers" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "transformers" not in imported


def test_a_reader_that_closes_the_pipe_ends_it_quietly_with_the_sigpipe_status(tmp_path: Path) -> None:
    """`dflash data inspect | head -1` printed a BrokenPipeError traceback and exited 1. The read end is closed before
    the process writes a byte (it builds a tokenizer first), so its first write meets a closed pipe every time."""
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"body": "some plain text " * 20}, {"body": "more plain text " * 30}]))
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")}
    p = subprocess.Popen([DFLASH, "data", "inspect", str(f), "--format", "text", "--text-field", "body"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err  # 128 + SIGPIPE, what a shell reports for `git log | head`
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_data_with_nothing_left_to_train_on_exits_1_saying_so(tmp_path: Path) -> None:
    """Every document under data.min_len: inspect printed `pieces: 0` and exited 0; the run failed minutes later."""
    f = tmp_path / "short.jsonl"
    f.write_text('{"text": "hi"}\n{"text": "yo"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {{paths: [{f.name}], vocab_size: 300, max_len: 32, min_len: 4, token_budget: 128, "
                   "num_buckets: 2}\n")
    r = _run(tmp_path, "--config", str(cfg))
    assert r.returncode == 1 and "pieces: 0" in r.stdout
    assert "nothing to train on: every document was dropped" in r.stderr
    js = _run(tmp_path, "--config", str(cfg), "--json")
    assert js.returncode == 1 and json.loads(js.stdout)["pieces"] == 0
    f.write_text('{"text": "a longer document with enough tokens to keep"}\n')
    assert _run(tmp_path, "--config", str(cfg)).returncode == 0


def test_an_empty_file_beside_others_and_a_file_read_twice_are_said(tmp_path: Path) -> None:
    """Issue 39: an empty .jsonl in a data directory and a path listed twice were read without a word (the second
    doubles that file's weight in training)."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": f"plain text number {i} " * 10}) + "\n" for i in range(6)))
    (d / "b.jsonl").write_text("")
    (d / "c.jsonl").write_text("\n\n")
    r = _run(tmp_path, str(d), str(d / "a.jsonl"))
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: {d / 'b.jsonl'}: no record in it (an empty file): nothing read from it",
                     f"note: {d / 'c.jsonl'}: no record in it (an empty file): nothing read from it",
                     f"note: {(d / 'a.jsonl').resolve()}: read 2 times (data.paths names it, or a directory holding "
                     "it, more than once): its documents count 2 times"]
    assert "documents: 12 (12 text)" in r.stdout  # reading is unchanged: said, not altered
    js = json.loads(_run(tmp_path, str(d), "--json").stdout)
    assert [n for n in js["notes"] if "read 2 times" in n] == [] and len(js["notes"]) == 2


def test_inspect_says_where_it_trains_a_tiny_bpe_and_only_when_it_does(tmp_path: Path) -> None:
    """Without data.tokenizer, inspect trains a BPE per corpus into the shared cache: one line on stderr says so and
    where; the second inspect finds it there and says nothing."""
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps({"text": f"plain text number {i} " * 10}) + "\n" for i in range(6)))
    r = _run(tmp_path, str(f))
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "tiny BPE" in x]
    made = list((tmp_path / "cache" / "tokenizer").glob("tiny-bpe-*.json"))
    assert len(made) == 1 and f"into {made[0]} " in line and line.startswith("dflash data inspect: no data.tokenizer")
    again = _run(tmp_path, str(f), "--json")
    assert again.returncode == 0 and "tiny BPE" not in again.stderr
