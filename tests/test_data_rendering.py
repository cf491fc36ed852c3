"""How chats are rendered for training (docs/data.md): Qwen3's empty thinking scaffold under `data.thinking: drop`,
a record's top-level `tools`, resuming runs started before `data.thinking` existed, and directories of parquet
shards."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dflash_fixtures import data_cfg, tiny_corpus

from dflash.data import (
    DataError,
    Document,
    build_schedule,
    corpus_fingerprint,
    load_or_build_schedule,
    load_tokenizer,
    read_documents,
    save_schedule,
    schedule_meta,
    tokenize,
)

# A template shaped like Qwen3's (Qwen/Qwen3-8B tokenizer_config.json, written anew for this test): tools in the
# system turn as <tools> JSON lines; the assistant turns after the last user query get a <think> block, the last one
# always (empty when there is no reasoning); tool calls as <tool_call> JSON; tool results in a user turn; and the
# generation prompt with enable_thinking=false ends with the empty block.
QWEN3_SHAPED = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for t in tools %}{{- '\\n' }}{{- t | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set c = m.content or '' %}
        {%- set r = '' %}
        {%- if '</think>' in c %}
            {%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set c = c.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last and (loop.last or r) %}
            {{- '<think>\\n' + r + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- c }}
        {%- for t in m.tool_calls or [] %}
            {{- '<tool_call>\\n{"name": "' + t.function.name + '", "arguments": ' }}
            {{- t.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# A template that knows no tools (and no thinking): tools must reach it as text in the system turn.
PLAIN = ("{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endfor -%}"
         "{%- if add_generation_prompt %}<|assistant|>{%- endif -%}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_CHAT = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "{\"temp\": -3}"},
    {"role": "assistant", "content": "It is -3 C in Oslo."},
]


def _hf_tokenizer(tmp_path: Path, template: str, name: str = "hf") -> str:
    """The tests' tiny BPE as a Hugging Face tokenizer with `template`, and Qwen3's turn and thinking markers as
    added tokens (as Qwen3's own tokenizer has them)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    _, tok, _ = tiny_corpus()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tok.source), eos_token="<|endoftext|>",
                                 pad_token="<|pad|>", mask_token="<|mask|>")
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    hf.chat_template = template
    hf.save_pretrained(str(tmp_path / name))
    return str(tmp_path / name)


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _encoded(tmp_path: Path, records: list[dict], **cfg: object) -> tuple[object, list[tuple[str, str]]]:
    """(tokenizer, [(rendered text, supervised text)]) of records as training sees them."""
    f = _write_jsonl(tmp_path / f"d{len(list(tmp_path.glob('d*.jsonl')))}.jsonl", records)
    dc = data_cfg(paths=[str(f)], **cfg)
    docs = read_documents(dc)
    tok = load_tokenizer(dc, docs, tmp_path / "tokcache")
    corpus = tokenize(docs, tok)
    out = []
    for ids, mask in zip(corpus.ids, corpus.loss_mask, strict=True):
        ids_l, mask_l = ids.tolist(), mask.tolist()
        out.append((tok.decode(ids_l), tok.decode([i for i, m in zip(ids_l, mask_l, strict=True) if m])))
    return tok, out


# ---------------------------------------------------------------------------------------------- 1. thinking scaffold
def test_thinking_drop_leaves_qwen3s_empty_think_block_unsupervised(tmp_path: Path) -> None:
    """Qwen3 writes `<think>\\n\\n</think>\\n\\n` into the last assistant turn; a non-thinking server puts it in the
    prompt (enable_thinking=False), so with drop it is context, in one-turn chats (rendered as growing prefixes) and
    in multi-turn ones (rendered once, turns located)."""
    hf = _hf_tokenizer(tmp_path, QWEN3_SHAPED)
    one = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>four"}]}
    multi = {"messages": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "A"},
                          {"role": "user", "content": "b?"}, {"role": "assistant", "content": "B"}]}
    _, drop = _encoded(tmp_path, [one, multi, {"messages": TOOL_CHAT}], tokenizer=hf)
    assert drop[0][0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nfour<|im_end|>\n")
    assert drop[0][1].startswith("four<|im_end|>") and "think" not in drop[0][1]
    assert drop[1][0].endswith("<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nb?<|im_end|>\n"
                               "<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n")
    assert drop[1][1] == "A<|im_end|>B<|im_end|>"
    assert "think" not in drop[2][1] and drop[2][1].endswith("It is -3 C in Oslo.<|im_end|>")
    assert drop[2][1].startswith('<tool_call>\n{"name": "get_weather"')  # the assistant's own call is supervised
    # keep: the block is what a thinking-mode model emits after the plain header, so it is supervised; the tokens are
    # the same either way (only the mask differs, so a schedule made under one setting still fits the other)
    _, keep = _encoded(tmp_path, [multi], tokenizer=hf, thinking="keep")
    assert keep[0][0] == drop[1][0]
    assert keep[0][1] == "A<|im_end|><think>\n\n</think>\n\nB<|im_end|>"


def test_thinking_drop_changes_nothing_for_templates_without_a_thinking_switch(tmp_path: Path) -> None:
    hf = _hf_tokenizer(tmp_path, PLAIN)
    recs = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}]}]
    _, drop = _encoded(tmp_path, recs, tokenizer=hf)
    _, keep = _encoded(tmp_path, recs, tokenizer=hf, thinking="keep")
    assert drop == keep == [("<|user|>2+2?<|end|><|assistant|>four<|end|>", "four<|end|>")]


# ---------------------------------------------------------------------------------------------- 2. tools
def test_tools_go_to_a_template_that_renders_them_and_are_never_supervised(tmp_path: Path) -> None:
    hf = _hf_tokenizer(tmp_path, QWEN3_SHAPED)
    rec = {"tools": TOOLS, "messages": [{"role": "system", "content": "be brief"}, *TOOL_CHAT]}
    as_string = {**rec, "tools": json.dumps(TOOLS)}  # LLaMA-Factory / SpecForge keep tools as a JSON string
    bare = {**rec, "tools": [TOOLS[0]["function"]]}  # a bare schema per tool
    _, out = _encoded(tmp_path, [rec, as_string, bare], tokenizer=hf)
    text, sup = out[0]
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n<tools>\n{\"type\": \"function\", \"function\": "
                           "{\"name\": \"get_weather\"")
    assert "Weather of a city" not in sup and "<tools>" not in sup
    assert sup.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert out[1] == out[2] == out[0]


def test_tools_become_a_system_preamble_for_the_tiny_bpe_and_templates_without_tools(tmp_path: Path) -> None:
    preamble = "# Tools\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>"
    _, tiny = _encoded(tmp_path, [{"tools": TOOLS, "messages": TOOL_CHAT}])
    assert tiny[0][0].startswith(f"<|system|>{preamble}<|end|><|user|>weather in Oslo?<|end|>")
    assert "<tools>" not in tiny[0][1] and tiny[0][1].endswith("It is -3 C in Oslo.<|end|>")
    hf = _hf_tokenizer(tmp_path, PLAIN)
    sys_chat = [{"role": "system", "content": "be brief"}, *TOOL_CHAT]
    _, plain = _encoded(tmp_path, [{"tools": TOOLS, "messages": sys_chat}], tokenizer=hf)
    assert plain[0][0].startswith(f"<|system|>be brief\n\n{preamble}<|end|><|user|>")
    assert "<tools>" not in plain[0][1]


def test_tools_are_part_of_the_fingerprint_only_where_a_record_has_them(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    legacy = hashlib.sha256(json.dumps([None, chat], ensure_ascii=False).encode() + b"\0").hexdigest()
    assert corpus_fingerprint([Document(messages=chat)]) == legacy  # what every chat hashed to before tools
    assert corpus_fingerprint([Document(messages=chat, tools=TOOLS)]) != legacy
    # a run started when tools were ignored is refused on such data, and told why and what restores it
    _, tok, _ = tiny_corpus()
    f = _write_jsonl(tmp_path / "t.jsonl", [{"tools": TOOLS, "messages": chat}, {"messages": chat}])
    hints = tokenize(read_documents(data_cfg(paths=[str(f)])), tok).hints
    assert hints == ["1 chat(s) carry top-level tools, which dflash renders into the prompt since it reads them "
                     "(before, they were ignored); to resume a run started before, remove them from the records"]


@pytest.mark.parametrize(("tools", "error"), [
    ("[{\"name\": ", "'tools' is a string but not valid JSON"),
    ({"name": "f"}, "'tools' must be a list of function schemas, got dict"),
    ([{"type": "function", "function": {"description": "no name"}}], r"tools\[0\] must be an object with function"),
])
def test_bad_tools_are_one_line_naming_the_record(tmp_path: Path, tools: object, error: str) -> None:
    f = _write_jsonl(tmp_path / "t.jsonl", [{"tools": tools, "messages": TOOL_CHAT}])
    with pytest.raises(DataError, match=rf"^{f}:1: {error}") as exc:
        read_documents(data_cfg(paths=[str(f)]))
    assert "\n" not in str(exc.value)


# ---------------------------------------------------------------------------------------------- 3. resume fingerprints
def _legacy_fingerprint(records: list[dict], tok: object) -> str:
    """The schedule fingerprint dflash gave chats before data.thinking existed: role and content as written."""
    h = hashlib.sha256()
    for r in records:
        msgs = [{"role": m["role"], "content": m["content"]} for m in r["messages"]]
        h.update(json.dumps([None, msgs], ensure_ascii=False).encode())
        h.update(b"\0")
    t = hashlib.sha256(h.hexdigest().encode())
    t.update(tok.content_hash.encode())  # type: ignore[attr-defined]
    t.update(str(tok.vocab_size).encode())  # type: ignore[attr-defined]
    return t.hexdigest()


def _old_schedule(path: Path, records: list[dict], tok: object, cfg: object) -> None:
    """A schedule.json as a run started before data.thinking wrote it (its fingerprint computed the old way)."""
    corpus = tokenize(read_documents(cfg), tok)  # type: ignore[arg-type]
    meta = {**schedule_meta(corpus, cfg, 0), "fingerprint": _legacy_fingerprint(records, tok)}  # type: ignore[arg-type]
    save_schedule(build_schedule(corpus, cfg, 0, 1), meta, path)  # type: ignore[arg-type]


def test_run_started_before_data_thinking_resumes_on_chats_without_thinking(tmp_path: Path) -> None:
    _, tok, _ = tiny_corpus()
    recs = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"the answer to question {i} is {i * 7}."}]}
            for i in range(12)]
    f = _write_jsonl(tmp_path / "chats.jsonl", recs)
    cfg = data_cfg(paths=[str(f)], min_len=4)  # thinking: drop, the default
    sched = tmp_path / "schedule.json"
    _old_schedule(sched, recs, tok, cfg)
    corpus = tokenize(read_documents(cfg), tok)
    assert corpus.hints == []
    resumed = load_or_build_schedule(corpus, cfg, 0, 1, sched, write=False)
    assert [[list(map(list, b)) for b in e] for e in resumed.epochs] == json.loads(sched.read_text())["epochs"]


def test_run_started_before_data_thinking_on_think_chats_is_told_to_set_thinking_keep(tmp_path: Path) -> None:
    _, tok, _ = tiny_corpus()
    recs = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"<think>\nmultiply {i} by 7\n</think>\n\n"
                                                           f"the answer is {i * 7}."}]} for i in range(12)]
    f = _write_jsonl(tmp_path / "chats.jsonl", recs)
    keep = data_cfg(paths=[str(f)], min_len=4, thinking="keep")
    sched = tmp_path / "schedule.json"
    _old_schedule(sched, recs, tok, keep)
    drop = data_cfg(paths=[str(f)], min_len=4)
    with pytest.raises(DataError) as exc:
        load_or_build_schedule(tokenize(read_documents(drop), tok), drop, 0, 1, sched, write=False)
    msg = str(exc.value)
    assert msg.startswith(f"{sched}: schedule was made for other data/settings: the corpus or tokenizer content")
    assert ("likely: 12 chat(s) hold thinking that data.thinking: drop renders unlike dflash before the setting "
            "existed") in msg
    assert "set data.thinking: keep to resume it" in msg and "\n" not in msg
    # and keep does restore the old rendering: the run resumes
    load_or_build_schedule(tokenize(read_documents(keep), tok), keep, 0, 1, sched, write=False)


def test_reasoning_content_under_keep_names_drop_as_the_old_rendering(tmp_path: Path) -> None:
    """Before data.thinking, `reasoning_content` was ignored: keep (which writes it into the turn) is what changed."""
    _, tok, _ = tiny_corpus()
    recs = [{"messages": [{"role": "user", "content": "q?"},
                          {"role": "assistant", "reasoning_content": "think hard", "content": "an answer"}]}] * 6
    f = _write_jsonl(tmp_path / "chats.jsonl", recs)
    corpus = tokenize(read_documents(data_cfg(paths=[str(f)], thinking="keep")), tok)
    assert len(corpus.hints) == 1 and "set data.thinking: drop to resume it" in corpus.hints[0]
    assert tokenize(read_documents(data_cfg(paths=[str(f)])), tok).hints == []


# ---------------------------------------------------------------------------------------------- 4. parquet directories
def _hub_snapshot(root: Path) -> Path:
    """A dataset laid out as on the Hugging Face hub: README, data/{split}-0000N-of-0000M.parquet."""
    import datasets

    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: mit\n---\n")
    for i in range(2):
        datasets.Dataset.from_dict({"text": [f"train shard {i} row {j}" for j in range(3)]}).to_parquet(
            str(root / "data" / f"train-0000{i}-of-00002.parquet"))
    datasets.Dataset.from_dict({"text": ["test row"]}).to_parquet(str(root / "data" / "test-00000-of-00001.parquet"))
    return root


def test_directory_of_parquet_shards_reads_the_train_split(tmp_path: Path) -> None:
    hub = _hub_snapshot(tmp_path / "hub")
    docs = read_documents(data_cfg(paths=[str(hub)]))
    assert [d.text for d in docs] == [f"train shard {i} row {j}" for i in range(2) for j in range(3)]
    assert docs[3].source == f"{hub}/data/train-00001-of-00002.parquet: record 1"
    (hub / "data" / "train-00000-of-00002.parquet").unlink()
    (hub / "data" / "train-00001-of-00002.parquet").unlink()
    with pytest.raises(DataError, match=rf"^{hub}: parquet shards of split\(s\) test and none of train: name the "
                                        "shards to read in data.paths$"):
        read_documents(data_cfg(paths=[str(hub)]))


def test_directory_of_unnamed_parquet_shards_reads_them_all_and_mixed_kinds_are_refused(tmp_path: Path) -> None:
    import datasets

    d = tmp_path / "shards"
    d.mkdir()
    for i in range(2):
        datasets.Dataset.from_dict({"text": [f"part {i}"]}).to_parquet(str(d / f"part-{i}.parquet"))
    assert [x.text for x in read_documents(data_cfg(paths=[str(d)]))] == ["part 0", "part 1"]
    (d / "extra.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match=rf"^{d}: holds both \.txt/\.jsonl files and \.parquet shards"):
        read_documents(data_cfg(paths=[str(d)]))


def test_directory_scan_never_reads_json_files_such_as_regen_json(tmp_path: Path) -> None:
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"text": "only me"}) + "\n")
    (d / "regen.json").write_text(json.dumps({"tokenizer": {"content_hash": "x"}}))
    assert [x.text for x in read_documents(data_cfg(paths=[str(d)]))] == ["only me"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.md").write_text("nothing")
    with pytest.raises(DataError, match=r"no \.txt or \.jsonl files \(nor \.parquet shards\) in this directory"):
        read_documents(data_cfg(paths=[str(empty)]))


def test_data_inspect_reads_a_hub_parquet_directory(tmp_path: Path) -> None:
    hub = _hub_snapshot(tmp_path / "hub")
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([str(Path(sys.executable).with_name("dflash")), "data", "inspect", str(hub), "--format",
                        "text"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert "documents: 6 (6 text)" in r.stdout, r.stderr  # the train split's six rows, the test split's not
    # a few words each, all under data.min_len: read, and said to be nothing to train on (exit 1)
    assert r.returncode == 1 and "nothing to train on" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------- 3. where a reply starts, ends
def test_the_newline_after_the_end_of_turn_is_context_in_one_turn_and_many(tmp_path: Path) -> None:
    """A server stops at <|im_end|>, so the newline Qwen's template writes after it is never generated: it was
    supervised in one-turn chats (growing prefixes) and not in multi-turn ones (rendered once); now in neither."""
    hf = _hf_tokenizer(tmp_path, QWEN3_SHAPED)
    one = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}]}
    _, out = _encoded(tmp_path, [one], tokenizer=hf)
    assert out[0][0].endswith("four<|im_end|>\n")
    assert out[0][1] == "four<|im_end|>"


def test_a_chat_opening_with_the_assistant_supervises_its_reply_not_the_template_around_it(tmp_path: Path) -> None:
    """ShareGPT chats sometimes open with the assistant (a greeting). Its header, and a default system turn a
    template adds before it, are the template's, never the reply (growing prefixes supervised them all, as HF
    renders no empty chat to subtract): such chats are rendered once and their assistant turns located."""
    greet = {"messages": [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "four"}]}
    _, plain = _encoded(tmp_path, [greet], tokenizer=_hf_tokenizer(tmp_path, PLAIN))
    assert plain == [("<|assistant|>Hello<|end|><|user|>2+2?<|end|><|assistant|>four<|end|>",
                      "Hello<|end|>four<|end|>")]
    default_system = ("{%- if messages[0].role != 'system' -%}<|system|>You are helpful.<|end|>{%- endif -%}" + PLAIN)
    _, sys_out = _encoded(tmp_path, [greet], tokenizer=_hf_tokenizer(tmp_path, default_system, "hf2"))
    assert sys_out[0][0].startswith("<|system|>You are helpful.<|end|><|assistant|>Hello")
    assert sys_out[0][1] == "Hello<|end|>four<|end|>"
