"""The record shapes users hold (docs/data.md): ShareGPT, OpenAI messages with tool turns, Hugging Face datasets, and
Qwen3-style thinking; what each supervises, and the one line a bad record gets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from dflash_fixtures import data_cfg, run_config, tiny_corpus

from dflash.config import ConfigError, config_from_dict
from dflash.data import DataError, load_tokenizer, read_documents, tokenize

CHAT = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "what is 2+2?"},
        {"from": "gpt", "value": "four"}, {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "six"}]

TOOL_CHAT = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": -3}"},
    {"role": "assistant", "content": "It is -3 C in Oslo."},
]

# A template in the way Qwen3's behaves (written for this test): thinking is rendered only for assistant turns after
# the last user message, tool results are wrapped in a user turn closed by whatever follows, and tool calls become
# <tool_call> JSON. Not prefix-stable, so the assistant turns are located in the whole rendered chat.
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}<|{{ m.role }}|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set c = m.content or '' -%}{%- set r = '' -%}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif -%}"
    "<|assistant|>{%- if loop.index0 > ns.last and r %}<think>\n{{ r }}\n</think>\n\n{%- endif -%}{{ c }}"
    "{%- for t in m.tool_calls or [] -%}<tool_call>{\"name\": \"{{ t.function.name }}\", \"arguments\": "
    "{{ t.function.arguments | tojson }}}</tool_call>{%- endfor -%}<|end|>"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|user|>{%- endif -%}"
    "<tool_response>{{ m.content }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|end|>{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif -%}")


def _supervised(tok, ids: list[int], mask: list[bool]) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _hf_tokenizer(tmp_path: Path, template: str) -> str:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    _, tok, _ = tiny_corpus()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tok.source), eos_token="<|endoftext|>",
                                 pad_token="<|pad|>", mask_token="<|mask|>")
    hf.chat_template = template
    hf.save_pretrained(str(tmp_path / "hf"))
    return str(tmp_path / "hf")


def test_sharegpt_jsonl_and_json_array_supervise_gpt_turns_only(tmp_path: Path) -> None:
    _, tok, _ = tiny_corpus()
    jl = _write_jsonl(tmp_path / "a.jsonl", [{"conversations": CHAT}])
    arr = tmp_path / "b.json"
    arr.write_text(json.dumps([{"conversations": CHAT}, {"conversations": CHAT[1:3]}]))
    docs = read_documents(data_cfg(paths=[str(jl), str(arr)], format="sharegpt"))
    assert [d.source for d in docs] == [f"{jl}:1", f"{arr}: record 1", f"{arr}: record 2"]
    assert [m["role"] for m in docs[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    corpus = tokenize(docs, tok)
    ids, mask = corpus.ids[0].tolist(), corpus.loss_mask[0].tolist()
    assert _supervised(tok, ids, mask) == "four<|end|>six<|end|>"
    # the same chat as OpenAI messages is the same document: ShareGPT is only another spelling
    openai = _write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
        for t in CHAT]}])
    assert read_documents(data_cfg(paths=[str(openai)]))[0].messages == docs[0].messages


def test_bad_sharegpt_role_is_one_line_naming_file_record_and_field(tmp_path: Path) -> None:
    bad = [*CHAT[:2], {"from": "bot", "value": "x"}]
    f = _write_jsonl(tmp_path / "x.jsonl", [{"conversations": CHAT}, {"conversations": bad}])
    with pytest.raises(DataError) as exc:
        read_documents(data_cfg(paths=[str(f)]))
    msg = str(exc.value)
    assert msg.startswith(f"{f}:2: conversations[2].from 'bot' is not one of human/gpt/system/user/assistant/tool")
    assert "\n" not in msg
    arr = tmp_path / "y.json"
    arr.write_text(json.dumps([{"conversations": CHAT}, {"conversations": [{"from": "human", "value": 3}]}]))
    with pytest.raises(DataError, match=r"y\.json: record 2: conversations\[0\]\.value must be a string"):
        read_documents(data_cfg(paths=[str(arr)]))
    # an image part among text parts is named (it said "... a list of text parts, got list" of a list)
    img = _write_jsonl(tmp_path / "img.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": "x.png"}}]},
        {"role": "assistant", "content": "a cat"}]}])
    with pytest.raises(DataError) as exc:
        read_documents(data_cfg(paths=[str(img)]))
    assert str(exc.value).startswith(f"{img}:1: messages[0].content[1]: a part of type 'image_url'; only text parts")


def test_tool_turns_with_tiny_tokenizer_supervise_the_assistants_call_not_the_result(tmp_path: Path) -> None:
    _, tok, _ = tiny_corpus()
    f = _write_jsonl(tmp_path / "t.jsonl", [{"messages": TOOL_CHAT}])
    docs = read_documents(data_cfg(paths=[str(f)]))
    call = docs[0].messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    ids, mask = (t.tolist() for t in (tokenize(docs, tok).ids[0], tokenize(docs, tok).loss_mask[0]))
    sup = _supervised(tok, ids, mask)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in sup
    assert "temp" not in sup and "weather in Oslo?" not in sup  # the tool result and the user are context
    assert sup.endswith("It is -3 C in Oslo.<|end|>")
    assert "<|tool|>" in tok.decode(ids)


def test_qwen3_like_template_masks_assistant_turns_and_tool_calls_not_tool_results(tmp_path: Path) -> None:
    """A template that is not prefix-stable (tool results closed by what follows, earlier thinking dropped) is
    rendered once; the assistant's own tool call is supervised in the template's format, the tool result is not."""
    hf = _hf_tokenizer(tmp_path, QWEN3_LIKE)
    chat = [*TOOL_CHAT[:3], {"role": "tool", "tool_call_id": "c2", "content": "{\"wind\": 5}"}, TOOL_CHAT[3]]
    f = _write_jsonl(tmp_path / "t.jsonl", [{"messages": chat}])
    cfg = data_cfg(paths=[str(f)], tokenizer=hf)
    docs = read_documents(cfg)
    tok = load_tokenizer(cfg, docs, tmp_path)
    corpus = tokenize(docs, tok)
    ids, mask = corpus.ids[0].tolist(), corpus.loss_mask[0].tolist()
    assert tok.decode(ids) == (
        "<|user|>weather in Oslo?<|end|><|assistant|><tool_call>{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Oslo\"}}</tool_call><|end|><|user|><tool_response>{\"temp\": -3}</tool_response>"
        "<tool_response>{\"wind\": 5}</tool_response><|end|><|assistant|>It is -3 C in Oslo.<|end|>")
    assert _supervised(tok, ids, mask) == (
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call><|end|>"
        "It is -3 C in Oslo.<|end|>")


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_thinking_keep_or_drop(tmp_path: Path, mode: str) -> None:
    _, tok, _ = tiny_corpus()
    f = _write_jsonl(tmp_path / "t.jsonl", [
        {"messages": [{"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nfour"}]},
        {"messages": [{"role": "user", "content": "3+3?"},
                      {"role": "assistant", "reasoning_content": "add again", "content": "six"}]},
        {"conversations": [{"from": "human", "value": "1+1?"},
                           {"from": "gpt", "value": "<think>trivial</think>two"}]}])
    docs = read_documents(data_cfg(paths=[str(f)], thinking=mode))
    replies = [d.messages[-1]["content"] for d in docs]
    if mode == "drop":
        assert replies == ["four", "six", "two"]
    else:
        assert replies == ["<think>\nadd them\n</think>\n\nfour", "<think>\nadd again\n</think>\n\nsix",
                           "<think>trivial</think>two"]
        corpus = tokenize(docs, tok)
        assert "add again" in _supervised(tok, corpus.ids[1].tolist(), corpus.loss_mask[1].tolist())


def test_qwen3_like_template_drops_earlier_thinking_as_the_template_does(tmp_path: Path) -> None:
    hf = _hf_tokenizer(tmp_path, QWEN3_LIKE)
    chat = [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "<think>x</think>A"},
            {"role": "user", "content": "b?"}, {"role": "assistant", "content": "<think>y</think>B"}]
    f = _write_jsonl(tmp_path / "t.jsonl", [{"messages": chat}])
    cfg = data_cfg(paths=[str(f)], tokenizer=hf, thinking="keep")
    docs = read_documents(cfg)
    tok = load_tokenizer(cfg, docs, tmp_path)
    corpus = tokenize(docs, tok)
    assert _supervised(tok, corpus.ids[0].tolist(), corpus.loss_mask[0].tolist()) == \
        "A<|end|><think>\ny\n</think>B<|end|>"  # x (before the last user turn) is gone, as in Qwen3


def test_hugging_face_dataset_on_disk_parquet_and_arrow_with_named_columns(tmp_path: Path) -> None:
    import datasets

    rows = {"body": ["first text", "second text"],
            "dialog": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]] * 2}
    ds = datasets.Dataset.from_dict(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in (tmp_path / "saved", tmp_path / "d.parquet", arrow):
        texts = read_documents(data_cfg(paths=[str(path)], format="text", text_field="body"))
        assert [d.text for d in texts] == ["first text", "second text"]
        chats = read_documents(data_cfg(paths=[str(path)], messages_field="dialog"))
        assert chats[1].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        assert chats[1].source == f"{path}: record 2"
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(read_documents(data_cfg(paths=[str(tmp_path / "dd")], format="text", text_field="body"))) == 2
    with pytest.raises(DataError, match=r"saved: record 1: expected a 'text' key"):
        read_documents(data_cfg(paths=[str(tmp_path / "saved")], format="text"))


def test_new_data_fields_are_validated_with_one_line() -> None:
    base = {"target": {"arch": {"num_hidden_layers": 3}}}
    with pytest.raises(ConfigError, match=r"data\.thinking: .*expected one of keep, drop, got 'maybe'"):
        config_from_dict({**base, "data": {"thinking": "maybe"}}, "c.yaml")
    with pytest.raises(ConfigError, match=r"data\.format: .*sharegpt"):
        config_from_dict({**base, "data": {"format": "alpaca"}}, "c.yaml")
    with pytest.raises(ConfigError, match=r"data\.text_field: .*empty"):
        config_from_dict({**base, "data": {"text_field": " "}}, "c.yaml")


@pytest.mark.slow
def test_tiny_training_run_on_a_sharegpt_file_trains(tmp_path: Path) -> None:
    from dflash.train import train

    convs = []
    for a in range(12):
        for b in range(12):
            convs.append({"conversations": [{"from": "human", "value": f"What is {a} plus {b}?"},
                                            {"from": "gpt", "value": f"{a} plus {b} is {a + b}. "
                                                                     f"Adding {a} and {b} gives {a + b}."}]})
    f = tmp_path / "chats.json"
    f.write_text(json.dumps(convs))
    cfg = run_config(data={"paths": [str(f)], "format": "sharegpt", "min_len": 4, "max_len": 48},
                     train={"max_steps": 16, "checkpoint_every": 0, "eval_every": 0})
    res = train(cfg, tmp_path / "run")
    assert res.exit_code == 0, res.reason
    assert all(math.isfinite(x) for x in res.losses) and len(res.losses) == 16
    assert sum(res.losses[-4:]) / 4 < sum(res.losses[:4]) / 4
    log = (tmp_path / "run" / "train.log").read_text()
    assert "data: documents: 144 (144 chats)" in log  # the inspect summary, once, at start
    assert log.count("data: documents:") == 1
    assert "[[" in log  # the first document with its supervised tokens marked


def test_a_byte_order_mark_is_read_and_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    """A Windows export starts with a UTF-8 BOM (json refused it: "Unexpected UTF-8 BOM"); a stray Latin-1 byte was
    reported at a decoder offset (`position 201`), not at the line to fix."""
    rec = json.dumps({"text": "some plain text " * 10})
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (rec + "\n").encode() * 2)
    arr = tmp_path / "bom.json"
    arr.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"text": "more text " * 10}]).encode())
    docs = read_documents(data_cfg(paths=[str(bom), str(arr)]))
    assert [d.text[:4] for d in docs] == ["some", "some", "more"]
    for name, body in (("bad.jsonl", (rec + "\n").encode() + b'{"text": "caf\xe9"}\n'),
                       ("bad.txt", b"first line\nsecond caf\xe9 line\n"),
                       ("bad.json", b'[{"text": "ok"},\n {"text": "caf\xe9"}]')):
        f = tmp_path / name
        f.write_bytes(body)
        with pytest.raises(DataError) as exc:
            read_documents(data_cfg(paths=[str(f)]))
        assert str(exc.value) == f"{f}:2: not UTF-8 text (byte 0xe9); save the file as UTF-8"
    txt = tmp_path / "bom.txt"  # a .txt keeps its BOM: part of the text earlier runs fingerprinted
    txt.write_bytes(b"\xef\xbb\xbfhello text")
    assert read_documents(data_cfg(paths=[str(txt)]))[0].text == "\ufeffhello text"


def test_a_json_array_saved_as_jsonl_says_to_rename_it(tmp_path: Path) -> None:
    for body in (json.dumps([{"conversations": CHAT}]), json.dumps([{"conversations": CHAT}], indent=1)):
        f = tmp_path / "dump.jsonl"
        f.write_text(body)
        with pytest.raises(DataError) as exc:
            read_documents(data_cfg(paths=[str(f)]))
        assert str(exc.value).startswith(f"{f}:1: ") and "reads from a .json file (rename it)" in str(exc.value)
        f.rename(tmp_path / "dump.json")
        assert len(read_documents(data_cfg(paths=[str(tmp_path / "dump.json")]))) == 1
        (tmp_path / "dump.json").unlink()
