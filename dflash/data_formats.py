"""Record shapes users hold, turned into the corpus's one chat form (docs/data.md).

Accepted, besides plain text: OpenAI-style `messages` (with `tool_calls` on assistant turns and `tool` turns),
ShareGPT `conversations` (`from`/`value`, roles human/gpt/system, also user/assistant/tool, function_call and
observation), in JSONL, a JSON array, or a Hugging Face dataset (`save_to_disk` directory, .parquet, .arrow) read
through `datasets`, imported only when such a file is named (it is an optional extra: `pip install
dflash-ops[data]`).

Every chat becomes a list of messages `{"role", "content"}` (plus `tool_calls`, `tool_call_id`, `name` where given),
the shape the tokenizer's chat template takes, and its record's top-level `tools` (function schemas) go with it. A plain chat normalises to exactly what it was before, so corpus
fingerprints (and the schedules keyed by them) of existing data do not change. A bad record is refused in one line
naming the file, the record and the field, like the rest of dflash/data.py: training on silently thinned data
would hide the problem.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash.config import DataConfig

# Chat roles of the corpus (the tiny BPE has one special token per role: dflash/data.py ROLE_TOKENS).
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names -> roles. function_call/observation are the tool-call variant (LLaMA-Factory's).
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}
THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
DATASET_SUFFIXES = (".parquet", ".arrow")
# Split names in a Hugging Face hub layout (data/train-00000-of-00004.parquet, default/train/0000.parquet): the
# keywords `datasets` itself maps to train/validation/test when it infers a dataset's data files.
SPLIT_NAME = re.compile(r"^(train|training|validation|valid|val|dev|test|testing|eval|evaluation)(?:$|[-_.0-9])")
SPLITS = {"training": "train", "valid": "validation", "val": "validation", "dev": "validation",
          "testing": "test", "eval": "test", "evaluation": "test"}


class RecordError(ValueError):
    """A malformed record; the message is the text after `FILE:RECORD: ` (dflash/data.py adds the place)."""


def read_utf8(path: Path, json_text: bool = True) -> str:
    """A data file's text. A JSON file's byte order mark (what Windows editors and exports put first) is dropped,
    not refused as "Unexpected UTF-8 BOM" (a .txt keeps it: it is part of the text a run's corpus fingerprint was
    taken over); bytes that are not UTF-8 are a RecordError naming the line they are on (`FILE:LINE: ...`, the one
    place to fix), not a decoder's offset. OSError is the caller's."""
    raw = path.read_bytes()
    if json_text and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise RecordError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8") \
            from None


def is_hf_dataset_dir(path: Path) -> bool:
    """A `Dataset.save_to_disk` / `DatasetDict.save_to_disk` directory."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


# ---------------------------------------------------------------------------------------------- records
def chat_keys(cfg: DataConfig) -> list[str]:
    """The record keys that hold a chat, in the order they are looked for."""
    if cfg.messages_field:
        return [cfg.messages_field]
    return {"auto": ["messages", "conversations"], "chat": ["messages"], "sharegpt": ["conversations"],
            "text": []}[cfg.format]


def expected_keys(cfg: DataConfig) -> str:
    keys = [f"'{k}'" for k in chat_keys(cfg)]
    if cfg.format in ("auto", "text"):
        keys.insert(0, f"'{cfg.text_field}'")
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} or {keys[-1]}"


def record_content(obj: dict[str, Any], cfg: DataConfig) -> tuple[str, Any] | None:
    """(`text`, value) or (`chat`, (key, turns)) for a record, or None when it has none of the configured keys."""
    for key in chat_keys(cfg):
        if key in obj:
            return "chat", (key, obj[key])
    if cfg.format in ("auto", "text") and cfg.text_field in obj:
        return "text", obj[cfg.text_field]
    return None


def _text(value: Any, field: str) -> str:
    """A message's content: a string, nothing (an assistant turn that only calls tools), or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for i, p in enumerate(value):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                kind = f"a part of type {p.get('type')!r}" if isinstance(p, dict) and p.get("type") else \
                    f"a {type(p).__name__}" if not isinstance(p, dict) else "a part without a type"
                raise RecordError(f"{field}[{i}]: {kind}; only text parts ({{'type': 'text', 'text': ...}}) can be "
                                  "trained on (a drafter of a text target sees no images or audio)")
        return "".join(p["text"] for p in value)
    raise RecordError(f"{field} must be a string or a list of text parts, got {type(value).__name__}")


def _tool_calls(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise RecordError(f"{field} must be a list, got {type(value).__name__}")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordError(f"{field}[{j}] must be an object with function.name (a string)")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise RecordError(f"{field}[{j}].function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise RecordError(f"{field}[{j}].function.arguments must be a JSON object")
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def apply_thinking(content: str, reasoning: Any, mode: str) -> str:
    """Qwen3-style thinking of an assistant turn: `<think>...</think>` in the content or a `reasoning_content`
    field. drop: removed. keep: kept in the content as `<think>\\n...\\n</think>\\n\\n` (the form Qwen3's template
    parses back, and plain text for templates that know no thinking)."""
    if mode == "drop":
        return THINK.sub("", content) if "<think>" in content else content
    if isinstance(reasoning, str) and reasoning.strip() and "<think>" not in content:
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    return content


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """A record's top-level `tools` (the function schemas offered to the model), OpenAI style
    `[{"type": "function", "function": {"name", "description", "parameters"}}]`, a bare `{"name", ...}` schema per
    tool, or the list as a JSON string (LLaMA-Factory's ShareGPT, SpecForge). None when the record offers none."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RecordError("'tools' is a string but not valid JSON") from None
        if not value:
            return None
    if not isinstance(value, list):
        raise RecordError(f"'tools' must be a list of function schemas, got {type(value).__name__}")
    out = []
    for j, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordError(f"tools[{j}] must be an object with function.name (a string)")
        out.append({"type": "function", "function": fn})
    return out


def renders_unlike_before(turns: Any, thinking: str) -> bool:
    """Whether `thinking` renders this chat's thinking unlike the reader before `data.thinking` existed, which took
    OpenAI turns' role and content only: `<think>` kept as written, `reasoning_content` ignored. So drop differs where
    a content holds a `<think>` block, keep where a `reasoning_content` is written into a turn without one."""
    if not isinstance(turns, list):
        return False
    for t in turns:
        if not isinstance(t, dict) or t.get("role") != "assistant" or not isinstance(t.get("content"), str):
            continue
        content, reasoning = t["content"], t.get("reasoning_content")
        if thinking == "drop" and THINK.search(content):
            return True
        if thinking == "keep" and isinstance(reasoning, str) and reasoning.strip() and "<think>" not in content:
            return True
    return False


def parse_turns(turns: Any, key: str, thinking: str) -> list[dict[str, Any]]:
    """One chat (`messages` or `conversations`) in the corpus's message form; RecordError names the field."""
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"'{key}' must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(turns):
        at = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise RecordError(f"{at} must be an object")
        extra: dict[str, Any] = {}
        if "role" in t:  # OpenAI style
            role = t["role"]
            if role not in ROLES:
                raise RecordError(f"{at}.role {role!r} is not one of {'/'.join(ROLES)}")
            if "content" not in t and not t.get("tool_calls"):
                raise RecordError(f"{at} has no 'content'")
            content = _text(t.get("content"), f"{at}.content")
            if t.get("tool_calls"):
                if role != "assistant":
                    raise RecordError(f"{at}.tool_calls: only assistant turns call tools (role is {role!r})")
                extra["tool_calls"] = _tool_calls(t["tool_calls"], f"{at}.tool_calls")
            if role == "tool":
                for k in ("tool_call_id", "name"):
                    if isinstance(t.get(k), str):
                        extra[k] = t[k]
        elif "from" in t:  # ShareGPT
            who = t["from"]
            if who not in SHAREGPT_ROLES:
                raise RecordError(f"{at}.from {who!r} is not one of {'/'.join(SHAREGPT_ROLES)}")
            role = SHAREGPT_ROLES[who]
            if not isinstance(t.get("value"), str):
                raise RecordError(f"{at}.value must be a string")
            content = t["value"]
            if who == "function_call":
                try:
                    call = json.loads(content)
                except json.JSONDecodeError:
                    raise RecordError(f"{at}.value: a function_call turn must hold a JSON tool call") from None
                extra["tool_calls"] = _tool_calls(call if isinstance(call, list) else [call], f"{at}.value")
                content = ""
        else:
            raise RecordError(f"{at} must have 'role' and 'content' (OpenAI) or 'from' and 'value' (ShareGPT)")
        if role == "assistant":
            content = apply_thinking(content, t.get("reasoning_content"), thinking)
        out.append({"role": role, "content": content, **extra})
    return out


# ---------------------------------------------------------------------------------------------- containers
def iter_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of a .json file: a JSON array of records (ShareGPT dumps), or JSON lines named .json."""
    try:
        raw = read_utf8(path)
    except OSError as exc:
        raise RecordError(f"cannot read: {exc}") from None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        obj = None
        if "\n" not in raw.strip():
            raise RecordError("not valid JSON") from None
    if obj is None:  # JSON lines in a file named .json
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                yield f"{path}:{n}", _json_line(line, f"{path}:{n}")
        return
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list):
        raise RecordError("expected a JSON array of records")
    for n, rec in enumerate(obj, 1):
        yield f"{path}: record {n}", rec


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{where}: not valid JSON ({exc.msg})") from None


def split_of(rel: Path) -> str | None:
    """The dataset split a shard belongs to by its path (a `train-00000-of-00004` name or a `train/` folder)."""
    for part in (*rel.parent.parts, rel.stem):
        m = SPLIT_NAME.match(part.lower())
        if m:
            return SPLITS.get(m.group(1), m.group(1))
    return None


def parquet_shards(directory: Path) -> list[Path]:
    """The .parquet shards of a directory that training reads: all of them, or only the train split's when the
    names mark splits (a hub snapshot also holds test/validation shards, which must not become training data)."""
    shards = sorted(q for q in directory.rglob("*.parquet") if q.is_file())
    splits = {q: split_of(q.relative_to(directory)) for q in shards}
    if "train" in splits.values():
        return [q for q in shards if splits[q] == "train"]
    named = sorted({s for s in splits.values() if s})
    if named:
        raise RecordError(f"parquet shards of split(s) {', '.join(named)} and none of train: name the shards to "
                          "read in data.paths")
    return shards


def iter_hf_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) of a Hugging Face dataset on disk: a `save_to_disk` directory (its `train` split when it holds
    several), a .parquet file or a .arrow file. Rows are numbered from 1, like lines."""
    try:
        import datasets
    except ImportError:
        raise RecordError("reading Hugging Face datasets needs the `datasets` package: "
                          "pip install 'dflash-ops[data]' (or pip install datasets)") from None
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                splits = list(ds)
                if "train" in ds:
                    ds = ds["train"]
                elif len(splits) == 1:
                    ds = ds[splits[0]]
                else:
                    raise RecordError(f"a dataset with splits {', '.join(splits)} and no 'train': "
                                      "name one split's directory in data.paths")
        elif path.suffix == ".parquet":
            import tempfile

            with tempfile.TemporaryDirectory(prefix="dflash-parquet-") as tmp:  # no cache left in ~/.cache
                ds = datasets.Dataset.from_parquet(str(path), cache_dir=tmp, keep_in_memory=True)
        else:
            ds = datasets.Dataset.from_file(str(path), in_memory=True)
    except RecordError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to open is one line naming the file
        raise RecordError(f"cannot read as a Hugging Face dataset: {type(exc).__name__}: {exc}") from None
    for n, row in enumerate(ds, 1):
        yield f"{path}: record {n}", row
