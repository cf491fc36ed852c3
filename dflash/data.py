"""Training data for the drafter: corpus -> tokenizer -> document pieces -> token-budget buffers -> epoch schedule.

A corpus is text, chats, or token records (`dflash regen` output: ids kept as ids, the target-generated ones
supervised, pinned to the tokenizer and target that made them by the `regen.json` next to them).

The schedule (which pieces form which buffer, in which order) is a pure function of the seed and is written to disk,
so a resumed run continues at the exact buffer and every rank agrees on it without talking.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash import data_formats as fmt

if TYPE_CHECKING:  # torch and the config (which imports torch) only where used: `dflash data inspect` stays light
    import torch

    from dflash.config import DataConfig

# Special tokens of the tiny BPE. The mask token is what the drafter fills its blocks with.
PAD, EOS, MASK = "<|pad|>", "<|endoftext|>", "<|mask|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [PAD, EOS, MASK, *ROLE_TOKENS.values(), END_OF_TURN]

Piece = tuple[int, int, int]  # (document index, start token, length)
_MAX_OPEN = 256


class DataError(ValueError):
    """Unusable training data; the message names the file (and line) so the CLI can print just that."""


# ---------------------------------------------------------------------------------------------- corpus
# The manifest `dflash regen` writes next to its records: which tokenizer the ids belong to, which target made them.
REGEN_MANIFEST = "regen.json"


@dataclass
class Document:
    """One training document: plain text (all tokens supervised), a chat (assistant turns supervised), or token ids
    with their loss mask (regenerated data: the target's own tokens supervised, the prompt not)."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None  # role, content (+ tool_calls / tool_call_id / name)
    source: str = ""
    ids: list[int] | None = None
    mask: list[bool] | None = None
    origin: dict[str, Any] | None = None  # token records: the regen manifest (tokenizer, target) they come with
    tools: list[dict[str, Any]] | None = None  # a chat's top-level function schemas: prompt context, never supervised
    # The data.thinking that renders this chat as dflash did before the setting existed, where the configured one
    # renders it otherwise ('' if it does not): named when a resume is refused (schedule_mismatch).
    legacy_thinking: str = ""


def embedded_corpus(max_chars: int) -> list[Document]:
    """Python's own standard-library sources: real text that exists on every machine that can run us.

    Files are taken in sorted order from the top level of the stdlib directory, so the corpus is the same on every
    machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        text = text[: max_chars - total]
        docs.append(Document(text=text, source=str(path)))
        total += len(text)
        if total >= max_chars:
            break
    if not docs:
        raise DataError(f"{root}: no Python sources found for the embedded corpus")
    return docs


def _iter_files(paths: Sequence[str]) -> Iterator[Path]:
    for raw in paths:
        p = Path(raw)
        if fmt.is_hf_dataset_dir(p):
            yield p
        elif p.is_dir():
            yield from _dir_files(p)
        elif p.is_file():
            yield p
        else:
            raise DataError(f"{p}: data file does not exist")


def _dir_files(p: Path) -> list[Path]:
    """A directory's data files: its .txt/.jsonl files (text, chats, or `dflash regen` records with their
    regen.json, which is never read as records), else its .parquet shards (a Hugging Face hub snapshot: only the train
    split's when names mark splits). Both kinds in one directory are refused rather than one silently ignored."""
    files = sorted(q for q in p.rglob("*") if q.suffix in (".txt", ".jsonl") and q.is_file())
    has_parquet = any(q.is_file() for q in p.rglob("*.parquet"))
    if files and has_parquet:
        raise DataError(f"{p}: holds both .txt/.jsonl files and .parquet shards; name the files or folders to read "
                        "in data.paths")
    if files:
        return files
    if has_parquet:
        try:
            return fmt.parquet_shards(p)
        except fmt.RecordError as exc:
            raise DataError(f"{p}: {exc}") from None
    raise DataError(f"{p}: no .txt or .jsonl files (nor .parquet shards) in this directory")


def _token_record(obj: dict[str, Any], where: str, origin: dict[str, Any] | None) -> Document:
    ids, mask = obj["input_ids"], obj.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                       for x in ids):
        raise DataError(f"{where}: 'input_ids' must be a non-empty list of token ids (integers >= 0)")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(x in (0, 1) for x in mask):
        raise DataError(f"{where}: 'loss_mask' must be a list of 0/1 (or booleans), one per input id")
    if origin is None:
        raise DataError(f"{where}: token records need the {REGEN_MANIFEST} that `dflash regen` writes next to them "
                        "(it names the tokenizer the ids belong to)")
    return Document(ids=[int(x) for x in ids], mask=[bool(x) for x in mask], source=where, origin=origin)


def read_regen_manifest(directory: Path) -> dict[str, Any] | None:
    """The regen manifest of a records directory, or None when there is none."""
    p = directory / REGEN_MANIFEST
    if not p.is_file():
        return None
    try:
        obj = json.loads(p.read_text())
        if not isinstance(obj.get("tokenizer"), dict) or "content_hash" not in obj["tokenizer"]:
            raise ValueError("no tokenizer.content_hash")
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"{p}: unreadable regen manifest ({exc})") from None
    obj["dir"] = str(directory)
    tpath = Path(str(obj["tokenizer"].get("path", "tokenizer")))
    obj["tokenizer"]["path"] = str(tpath if tpath.is_absolute() else directory / tpath)  # the records dir may move
    return dict(obj)


def read_documents(cfg: DataConfig, notes: list[str] | None = None) -> list[Document]:
    """Read every configured file (or the embedded corpus); any malformed line is a DataError naming file:line.

    `notes` receives one line per thing a person likely did not mean and the reading did not refuse: a file with no
    record beside others (nothing read from it), a file read more than once (listed twice, or listed and inside a
    listed directory: its documents count that many times)."""
    if not cfg.paths:
        return embedded_corpus(cfg.max_chars)
    docs: list[Document] = []
    manifests: dict[Path, dict[str, Any] | None] = {}
    reads: dict[Path, int] = {}
    empty: list[Path] = []
    for path in _iter_files(cfg.paths):
        got = _read_path(path, cfg, manifests)
        key = path.resolve()
        reads[key] = reads.get(key, 0) + 1
        if reads[key] == 1 and (not got or all(d.text is not None and not d.text.strip() for d in got)):
            empty.append(path)
        docs.extend(got)
    if not docs:
        raise DataError(f"{', '.join(cfg.paths)}: no documents")
    if notes is not None:
        notes += [f"{p}: no record in it (an empty file): nothing read from it" for p in empty]
        notes += [f"{p}: read {n} times (data.paths names it, or a directory holding it, more than once): its "
                  f"documents count {n} times" for p, n in reads.items() if n > 1]
    return docs


def _read_path(path: Path, cfg: DataConfig, manifests: dict[Path, dict[str, Any] | None]) -> list[Document]:
    """One configured file's (or dataset directory's) documents."""
    if path.is_dir() or path.suffix in (".json", *fmt.DATASET_SUFFIXES):
        return list(read_records(path, cfg))
    if path.suffix == ".txt" and cfg.format in ("auto", "text"):
        try:
            return [Document(text=fmt.read_utf8(path, json_text=False), source=str(path))]
        except OSError as exc:
            raise DataError(f"{path}: cannot read: {exc}") from None
        except fmt.RecordError as exc:
            raise DataError(str(exc)) from None
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: expected a .txt or .jsonl file (data.format={cfg.format})")
    try:
        lines = fmt.read_utf8(path).splitlines()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    except fmt.RecordError as exc:
        raise DataError(str(exc)) from None
    docs: list[Document] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        # a ShareGPT dump (one JSON array) saved as .jsonl: say how it is read instead of what is wrong
        array = ("; this file looks like one JSON array, which dflash reads from a .json file (rename it), a "
                 ".jsonl holding one object per line") if line.lstrip().startswith("[") else ""
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg}){array}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object{array}")
        if "input_ids" in obj and cfg.format == "auto":
            if path.parent not in manifests:
                manifests[path.parent] = read_regen_manifest(path.parent)
            docs.append(_token_record(obj, where, manifests[path.parent]))
        else:
            docs.append(record_document(obj, where, cfg))
    return docs


def record_document(obj: Any, where: str, cfg: DataConfig) -> Document:
    """One text or chat record (any shape dflash/data_formats.py reads) as a Document; DataError names the place."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object")
    found = fmt.record_content(obj, cfg)
    if found is None:
        raise DataError(f"{where}: expected a {fmt.expected_keys(cfg)} key")
    kind, value = found
    if kind == "text":
        if not isinstance(value, str):
            raise DataError(f"{where}: '{cfg.text_field}' must be a string")
        return Document(text=value, source=where)
    key, turns = value
    try:
        return Document(messages=fmt.parse_turns(turns, key, cfg.thinking), source=where,
                        tools=fmt.parse_tools(obj.get("tools")),
                        legacy_thinking=({"drop": "keep", "keep": "drop"}[cfg.thinking]
                                         if fmt.renders_unlike_before(turns, cfg.thinking) else ""))
    except fmt.RecordError as exc:
        raise DataError(f"{where}: {exc}") from None


def read_records(path: Path, cfg: DataConfig) -> list[Document]:
    """Documents of a .json file or a Hugging Face dataset (`save_to_disk` directory, .parquet, .arrow)."""
    it = fmt.iter_json_array(path) if path.suffix == ".json" else fmt.iter_hf_dataset(path)
    docs = []
    try:
        for where, rec in it:
            docs.append(record_document(rec, where, cfg))
    except fmt.RecordError as exc:
        msg = str(exc)
        raise DataError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    return docs


def corpus_fingerprint(docs: Sequence[Document]) -> str:
    """sha256 over the corpus content, so a cached tokenizer or schedule is never reused for other data."""
    h = hashlib.sha256()
    for d in docs:
        if d.ids is not None:  # token records: the ids and what is supervised (text documents hash as before)
            h.update(json.dumps([None, None, d.ids, d.mask]).encode())
        elif d.tools:  # rendered into the prompt: part of the data (chats without tools hash as before)
            h.update(json.dumps([d.text, d.messages, d.tools], ensure_ascii=False).encode())
        else:
            h.update(json.dumps([d.text, d.messages], ensure_ascii=False).encode())
        h.update(b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- tokenizer
class TokenizerAdapter:
    """One interface over the tiny BPE (`tokenizers.Tokenizer`) and a Hugging Face tokenizer directory."""

    def __init__(self, *, tiny: Any = None, hf: Any = None, source: str = "", thinking: str = "keep") -> None:
        self._tiny = tiny
        self._hf = hf
        self.source = source
        # data.thinking: with drop, the template's non-thinking scaffold (Qwen3's empty <think></think>) is context
        self.thinking = thinking
        if tiny is not None:
            self.vocab_size = int(tiny.get_vocab_size())
            self.pad_id = int(tiny.token_to_id(PAD))
            self.eos_id = int(tiny.token_to_id(EOS))
            self.mask_token_id: int | None = int(tiny.token_to_id(MASK))
        else:
            self.vocab_size = len(hf)
            self.eos_id = hf.eos_token_id if hf.eos_token_id is not None else 0
            self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id
            mask = hf.mask_token_id if getattr(hf, "mask_token_id", None) is not None else None
            self.mask_token_id = mask
        self.content_hash = self._content_hash()

    def _content_hash(self) -> str:
        """sha256 of what the tokenizer does (vocabulary, merges, normalisation, special tokens), not where it lives:
        a run directory that is moved, copied or named by another path must still match its schedule."""
        h = hashlib.sha256()
        if self._tiny is not None:
            h.update(self._tiny.to_str().encode())
            return h.hexdigest()
        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer: its whole tokenizer.json
            h.update(backend.to_str().encode())
        else:
            h.update(json.dumps(sorted(self._hf.get_vocab().items()), ensure_ascii=False).encode())
        h.update(json.dumps([str(t) for t in getattr(self._hf, "all_special_tokens", [])]).encode())
        h.update(str(getattr(self._hf, "chat_template", None)).encode())
        return h.hexdigest()

    def encode(self, text: str) -> list[int]:
        if self._tiny is not None:
            return list(self._tiny.encode(text).ids)
        return list(self._hf(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []  # HF fast tokenizers fail on an empty batch
        if self._tiny is not None:
            return [list(e.ids) for e in self._tiny.encode_batch(texts)]
        return [list(x) for x in self._hf(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        if self._tiny is not None:
            return str(self._tiny.decode(list(ids), skip_special_tokens=False))
        return str(self._hf.decode(list(ids)))

    def stop_ids(self) -> list[int]:
        """Tokens that end a generated reply: end of text, and the end-of-turn marker of the chat format."""
        out = {int(self.eos_id)}
        if self._tiny is not None:
            out.add(int(self._tiny.token_to_id(END_OF_TURN)))
        else:
            vocab = self._hf.get_vocab()
            out.update(int(vocab[t]) for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>") if t in vocab)
        return sorted(out)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The ids of a conversation up to and including the assistant's turn header: what a reply continues.

        Rendered as encode_chat renders the context of a reply that ends the chat (the same tools, tool calls in the
        same form, and under data.thinking: drop the template's non-thinking prompt, Qwen3's enable_thinking=False),
        so what `dflash regen` and `dflash eval` send the target is what training puts before that reply."""
        if self._tiny is not None:
            ids, _ = self.encode_chat(messages, tools) if messages else ([], [])
            return [*ids, int(self._tiny.token_to_id(ROLE_TOKENS["assistant"]))]
        messages, tools = self._with_tools(self._template_messages(messages), tools)
        prompt = self._render(messages, generation_prompt=True, tools=tools)
        if self.thinking == "drop":  # the same choice as _encode_chat_prefixes makes for a turn that ends the chat
            quiet = self._render(messages, generation_prompt=True, tools=tools, enable_thinking=False)
            if quiet != prompt and quiet[: len(prev := self._render(messages, False, tools))] == prev:
                prompt = quiet
        return prompt

    def thinking_switch_renders(self) -> bool:
        """Whether data.thinking: drop makes this tokenizer's generation prompts unlike its default ones (Qwen3's end
        with an empty think block): the one case where the setting changes a prompt that holds no thinking, so
        regen's and the held-out set's cache keys name it then only (and keep their old key otherwise)."""
        if self._hf is None or self.thinking != "drop":
            return False
        probe = [{"role": "user", "content": "dflash probe question"}]
        return self.chat_prompt(probe) != self._render(probe, generation_prompt=True)

    def save(self, directory: Path) -> dict[str, Any]:
        """Write this tokenizer into `directory` (the tiny BPE as tokenizer.json; an HF one: its own files) and return
        the manifest entry `load_pinned_tokenizer` reads back."""
        directory.mkdir(parents=True, exist_ok=True)
        if self._tiny is not None:
            self._tiny.save(str(directory / "tokenizer.json"))
            kind = "tiny"
        else:
            self._hf.save_pretrained(str(directory))
            kind = "hf"
        return {"kind": kind, "path": str(directory), "content_hash": self.content_hash, "vocab_size": self.vocab_size}

    def encode_chat(self, messages: list[dict[str, str]],
                    tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[bool]]:
        """Token ids and a loss mask that is True exactly on the assistant's tokens (content + end of turn). `tools`
        (the record's function schemas) go to the template, or into the system turn as text: context either way."""
        if self._tiny is not None:
            if tools:
                messages = with_tools_preamble(messages, tools)
            ids: list[int] = []
            mask: list[bool] = []
            end = int(self._tiny.token_to_id(END_OF_TURN))
            for m in messages:
                body = [int(self._tiny.token_to_id(ROLE_TOKENS[m["role"]])), *self.encode(flat_content(m))]
                supervised = m["role"] == "assistant"
                ids += [*body, end]
                mask += [False] + [supervised] * (len(body) - 1) + [supervised]
            return ids, mask
        messages, tools = self._with_tools(self._template_messages(messages), tools)
        try:
            return self._encode_chat_prefixes(messages, tools)
        except _PrefixUnstable:
            # Templates that render a turn differently once more turns follow (Qwen3's drops earlier thinking and
            # closes tool results by what comes next): the whole chat rendered once, assistant turns found in it.
            return self._encode_chat_spans(messages, tools)

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools for the template): tools stay structured where the template renders them (its own
        tools prompt is what the target saw), else they are written into the system turn as the tiny BPE does."""
        if not tools or self._renders_tools():
            return messages, tools or None
        return with_tools_preamble(messages, tools), None

    def _renders_tools(self) -> bool:
        if not hasattr(self, "_tools_rendered"):
            probe = [{"type": "function", "function": {"name": "dflash_probe_tool", "description": "probe",
                                                       "parameters": {"type": "object", "properties": {}}}}]
            try:
                out = self._hf.apply_chat_template([{"role": "user", "content": "x"}], tools=probe, tokenize=False)
                self._tools_rendered = "dflash_probe_tool" in str(out)
            except Exception:  # noqa: BLE001 - a template that refuses tools does not render them
                self._tools_rendered = False
        return self._tools_rendered

    def _encode_chat_prefixes(self, messages: list[dict[str, Any]],
                              tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[bool]]:
        # HF: render growing prefixes with the model's own chat template; the tokens a message adds belong to it.
        # Before an assistant turn the prefix is rendered with the generation prompt, so the assistant header the
        # template adds is context (unsupervised) and only what the assistant wrote is supervised.
        ids: list[int] = []
        mask: list[bool] = []
        prev: list[int] = []

        def extend(cur: list[int], supervised: bool) -> None:
            nonlocal prev
            if cur[: len(prev)] != prev:
                raise _PrefixUnstable(f"{self.source}: the chat template is not prefix-stable (an earlier turn renders "
                                "differently once more turns follow); cannot mask assistant turns")
            new = cur[len(prev):]
            ids.extend(new)
            mask.extend([supervised] * len(new))
            prev = cur

        for i, m in enumerate(messages):
            full = self._render(messages[: i + 1], generation_prompt=False, tools=tools)
            supervised = m["role"] == "assistant"
            if supervised and i > 0:
                prompt = self._render(messages[:i], generation_prompt=True, tools=tools)
                if self.thinking == "drop":
                    # The server's non-thinking prompt (Qwen3: enable_thinking=False ends it with an empty
                    # <think></think>): that scaffold is the prompt's, not the reply's, where the turn renders it.
                    quiet = self._render(messages[:i], generation_prompt=True, tools=tools, enable_thinking=False)
                    if quiet[: len(prev)] == prev and full[: len(quiet)] == quiet:
                        prompt = quiet
                extend(prompt, False)
            elif supervised:
                # A chat that opens with the assistant: HF renders no empty chat, so the prefix before this turn (its
                # header, a default system turn) cannot be told apart here; the rendered-once path locates it.
                raise _PrefixUnstable(f"{self.source}: the chat opens with an assistant turn")
            start = len(ids)
            extend(full, supervised)
            if supervised:
                # What the template writes after the end of turn (Qwen's newline after <|im_end|>) is never generated
                # (a server stops at the end of turn): context, as the rendered-once path has it.
                k = len(ids)
                while k > start and not self._hf.decode([ids[k - 1]]).strip():
                    k -= 1
                mask[k:] = [False] * (len(ids) - k)
        return ids, mask

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, enable_thinking: bool | None = None) -> list[int]:
        extra: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        out = self._hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                           return_dict=False, tools=tools, **extra)
        return [int(x) for x in out]

    def _render_text(self, messages: list[dict[str, Any]], generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None, enable_thinking: bool | None = None) -> str:
        extra: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            return str(self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                    tools=tools, **extra))
        except Exception as exc:  # noqa: BLE001 - jinja raises what the template raises (unknown role, ...)
            raise DataError(f"{self.source}: the chat template cannot render this chat: {exc}") from None

    def _thinking_scaffold(self) -> str:
        """What this template's non-thinking generation prompt adds after its assistant header (Qwen3:
        `<think>\n\n</think>\n\n`, the empty block it also writes into the last assistant turn), or ''."""
        if not hasattr(self, "_scaffold"):
            user = [{"role": "user", "content": "dflash probe question"}]
            prompt = self._render_text(user, True)
            quiet = self._render_text(user, True, enable_thinking=False)
            self._scaffold = quiet[len(prompt):] if quiet.startswith(prompt) else ""
        return self._scaffold

    def _template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as this template takes them: tool calls stay structured where the template renders them (its
        own tool-call format is what the target saw), else they are written into the content as text."""
        if not any(m.get("tool_calls") for m in messages) or self._renders_tool_calls():
            return messages
        return [{"role": m["role"], "content": flat_content(m)} for m in messages]

    def _renders_tool_calls(self) -> bool:
        if not hasattr(self, "_tools_ok"):
            probe = [{"role": "user", "content": "x"},
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": "dflash_probe_fn", "arguments": {}}}]}]
            try:
                self._tools_ok = "dflash_probe_fn" in str(self._hf.apply_chat_template(probe, tokenize=False))
            except Exception:  # noqa: BLE001 - a template that refuses tool calls does not render them
                self._tools_ok = False
        return self._tools_ok

    def _assistant_markers(self) -> tuple[str, str]:
        """The text this template puts before an assistant turn's content (its generation prompt) and right after it
        (its end of turn), found by rendering a probe chat."""
        if not hasattr(self, "_markers"):
            user = [{"role": "user", "content": "dflash probe question"}]
            bare, prompt = self._render_text(user, False), self._render_text(user, True)
            full = self._render_text([*user, {"role": "assistant", "content": "dflash probe answer"}], False)
            at = full.find("dflash probe answer")
            header = prompt[len(bare):] if prompt.startswith(bare) else ""
            end = full[at + len("dflash probe answer"):].rstrip() if at >= 0 else ""
            if not header.strip() or not end:
                raise DataError(f"{self.source}: the chat template is not prefix-stable and its assistant turns "
                                "cannot be located (no generation prompt or end-of-turn text); cannot mask them")
            self._markers = (header, end)
        return self._markers

    def _encode_chat_spans(self, messages: list[dict[str, Any]],
                           tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[bool]]:
        """The chat rendered once; supervised: each assistant turn from after its header through its end of turn
        (its content, thinking and own tool calls), never a tool result or a user turn. With data.thinking: drop,
        the template's empty thinking scaffold at a turn's start is context too."""
        header, end = self._assistant_markers()
        scaffold = self._thinking_scaffold() if self.thinking == "drop" else ""
        text = self._render_text(messages, False, tools)
        spans, pos = [], 0
        while (i := text.find(header, pos)) >= 0:
            s = i + len(header)
            if scaffold and text.startswith(scaffold, s):
                s += len(scaffold)
            e = text.find(end, s)
            e = len(text) if e < 0 else e + len(end)
            spans.append((s, e))
            pos = e
        want = sum(m["role"] == "assistant" for m in messages)
        if len(spans) != want:
            raise DataError(f"{self.source}: found {len(spans)} assistant turns in the rendered chat, expected {want} "
                            "(the chat template marks them in a way dflash cannot locate); cannot mask them")
        enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = [int(x) for x in enc["input_ids"]]
        mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
        return ids, mask


class _PrefixUnstable(DataError):
    """The chat template renders an earlier turn differently once more turns follow."""


def flat_content(m: dict[str, Any]) -> str:
    """A message's content with its tool calls written out as text (`<tool_call>` JSON, the Hermes/Qwen form): how
    the tiny BPE and templates without tool support see an assistant's tool call."""
    calls = m.get("tool_calls") or []
    if not calls:
        return str(m["content"])
    parts = [str(m["content"])] if m["content"] else []
    parts += [f"<tool_call>\n{json.dumps(c['function'], ensure_ascii=False)}\n</tool_call>" for c in calls]
    return "\n".join(parts)


def tools_block(tools: list[dict[str, Any]]) -> str:
    """A record's function schemas as text, one JSON object a line in `<tools>` (the form Qwen3's template uses)."""
    return "# Tools\n<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>"


def with_tools_preamble(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat with its tools written into the system turn (appended to the first system message, or a new one
    first): how the tiny BPE and templates that render no tools see them; a system turn is never supervised."""
    block = tools_block(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def train_tiny_tokenizer(docs: Sequence[Document], vocab_size: int) -> Any:
    """Train a byte-level BPE on the corpus (a few seconds): no download, and every byte is representable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for d in docs:
            if d.text is not None:
                yield d.text
            else:
                yield from (flat_content(m) for m in d.messages or [])
                if d.tools:
                    yield tools_block(d.tools)

    tok.train_from_iterator(texts(), trainer)
    return tok


def load_pinned_tokenizer(entry: dict[str, Any], where: str) -> TokenizerAdapter:
    """The tokenizer a regen manifest names (saved next to the records); refused if its content changed."""
    path = Path(str(entry.get("path", "")))
    try:
        if entry.get("kind") == "tiny":
            from tokenizers import Tokenizer

            tok = TokenizerAdapter(tiny=Tokenizer.from_file(str(path / "tokenizer.json")), source=str(path))
        else:
            from transformers import AutoTokenizer

            tok = TokenizerAdapter(hf=AutoTokenizer.from_pretrained(str(path)), source=str(path))
    except Exception as exc:  # noqa: BLE001 - any failure to load is one line naming the manifest
        raise DataError(f"{where}: cannot load the tokenizer the records were made with ({path}): {exc}") from None
    if tok.content_hash != entry.get("content_hash"):
        raise DataError(f"{where}: the tokenizer at {path} is not the one the records were made with")
    return tok


def pinned_origin(docs: Sequence[Document]) -> dict[str, Any] | None:
    """The one regen manifest the corpus's token records share (None without token records); mixed ones refused."""
    origins = {json.dumps(d.origin["tokenizer"], sort_keys=True): d for d in docs if d.origin is not None}
    if len(origins) > 1:
        a, b = list(origins.values())[:2]
        raise DataError(f"{a.source} and {b.source}: token records made with different tokenizers cannot be mixed")
    return next(iter(origins.values())).origin if origins else None


def tiny_tokenizer_name(cfg: DataConfig, docs: Sequence[Document]) -> str:
    """The cache file name of the tiny BPE for this corpus and vocabulary size (content-addressed)."""
    key = hashlib.sha256(f"{corpus_fingerprint(docs)}:{cfg.vocab_size}:{SPECIAL_TOKENS}".encode()).hexdigest()[:16]
    return f"tiny-bpe-{key}.json"


def bpe_to_train(cfg: DataConfig, docs: Sequence[Document], cache_dir: str | Path) -> Path | None:
    """The file load_tokenizer would train a tiny BPE into (no data.tokenizer, no pinned records, none cached yet);
    None when it would load one instead."""
    if cfg.tokenizer is not None or pinned_origin(docs) is not None:
        return None
    cache = Path(cache_dir) / tiny_tokenizer_name(cfg, docs)
    return None if cache.is_file() else cache


def load_tokenizer(cfg: DataConfig, docs: Sequence[Document], cache_dir: str | Path) -> TokenizerAdapter:
    """The configured HF tokenizer, the one regenerated records are pinned to, or the tiny BPE from cache (keyed by
    corpus and vocab size) or trained now; it renders chats with the config's data.thinking."""
    tok = _load_tokenizer(cfg, docs, cache_dir)
    tok.thinking = cfg.thinking
    return tok


def _load_tokenizer(cfg: DataConfig, docs: Sequence[Document], cache_dir: str | Path) -> TokenizerAdapter:
    origin = pinned_origin(docs)
    if origin is not None and cfg.tokenizer is None:
        return load_pinned_tokenizer(origin["tokenizer"], f"{origin.get('dir', '')}/{REGEN_MANIFEST}")
    if cfg.tokenizer is not None:
        path = Path(cfg.tokenizer)
        if not path.is_dir():
            raise DataError(f"{path}: data.tokenizer must be a local tokenizer directory")
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: cannot load tokenizer: {exc}") from None
        return TokenizerAdapter(hf=hf, source=str(path))
    from tokenizers import Tokenizer

    cache = Path(cache_dir) / tiny_tokenizer_name(cfg, docs)
    if cache.is_file():
        try:
            return TokenizerAdapter(tiny=Tokenizer.from_file(str(cache)), source=str(cache))
        except Exception:  # noqa: BLE001 - a broken cache file is simply retrained
            pass
    tok = train_tiny_tokenizer(docs, cfg.vocab_size)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, cache)
    return TokenizerAdapter(tiny=tok, source=str(cache))


# ---------------------------------------------------------------------------------------------- tokenized corpus
@dataclass
class TokenizedCorpus:
    """Token ids and loss masks of every document, kept whole; pieces index into them."""

    ids: list[torch.Tensor]  # int64 [len]
    loss_mask: list[torch.Tensor]  # bool [len]
    fingerprint: str
    hints: list[str] = field(default_factory=list)  # likely causes of a fingerprint change (schedule_mismatch)

    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.ids]


def tokenize(docs: Sequence[Document], tok: TokenizerAdapter) -> TokenizedCorpus:
    """Text documents end with EOS and are fully supervised; chats are supervised on assistant tokens only."""
    import torch

    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for seq, m in token_lists(docs, tok):
        ids.append(torch.tensor(seq, dtype=torch.long))
        masks.append(torch.tensor(m, dtype=torch.bool))
    h = hashlib.sha256(corpus_fingerprint(docs).encode())
    h.update(tok.content_hash.encode())
    h.update(str(tok.vocab_size).encode())
    return TokenizedCorpus(ids=ids, loss_mask=masks, fingerprint=h.hexdigest(), hints=rendering_hints(docs))


def rendering_hints(docs: Sequence[Document]) -> list[str]:
    """Why this corpus may fingerprint unlike the one a run started with, though its files did not change: how
    chats are rendered changed (data.thinking's default, tools now read). Named in the resume refusal."""
    hints = []
    for fix in ("keep", "drop"):
        n = sum(d.legacy_thinking == fix for d in docs)
        if n:
            now = "drop" if fix == "keep" else "keep"
            hints.append(f"{n} chat(s) hold thinking that data.thinking: {now} renders unlike dflash before the "
                         "setting existed (it kept <think> blocks as written and ignored reasoning_content); if this "
                         f"run started before, set data.thinking: {fix} to resume it")
    tooled = sum(bool(d.tools) for d in docs)
    if tooled:
        hints.append(f"{tooled} chat(s) carry top-level tools, which dflash renders into the prompt since it reads "
                     "them (before, they were ignored); to resume a run started before, remove them from the records")
    return hints


def token_lists(docs: Sequence[Document], tok: TokenizerAdapter) -> Iterator[tuple[list[int], list[bool]]]:
    """(ids, loss mask) of every document as plain lists: the body of tokenize, and all `dflash data inspect`
    needs (it counts and packs without torch)."""
    text_idx = [i for i, d in enumerate(docs) if d.text is not None]
    encoded = dict(zip(text_idx, tok.encode_batch([docs[i].text or "" for i in text_idx]), strict=True))
    for i, d in enumerate(docs):
        if d.ids is not None:  # token records: kept as ids, checked against the tokenizer they were made with
            if d.origin is not None and d.origin["tokenizer"].get("content_hash") != tok.content_hash:
                raise DataError(f"{d.source}: these token ids were made with another tokenizer than the run's "
                                f"({tok.source}); leave data.tokenizer unset to use the records' own")
            if max(d.ids) >= tok.vocab_size:
                raise DataError(f"{d.source}: token id {max(d.ids)} is outside the vocabulary ({tok.vocab_size})")
            seq, m = d.ids, d.mask or [True] * len(d.ids)
        elif d.text is not None:
            seq = [*encoded[i], tok.eos_id]
            m = [True] * len(seq)
        else:
            seq, m = tok.encode_chat(d.messages or [], d.tools)
        yield seq, m


# ---------------------------------------------------------------------------------------------- schedule
def make_pieces(lengths: Sequence[int], max_len: int, min_len: int = 2) -> list[Piece]:
    """Split every document into consecutive pieces of at most max_len tokens; drop pieces shorter than min_len."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    pieces: list[Piece] = []
    for doc, n in enumerate(lengths):
        for start in range(0, n, max_len):
            length = min(max_len, n - start)
            if length >= max(2, min_len):
                pieces.append((doc, start, length))
    return pieces


def pack_epoch(pieces: Sequence[Piece], token_budget: int, max_len: int, num_buckets: int, seed: int,
               epoch: int) -> list[list[Piece]]:
    """One epoch's buffers: pieces grouped by length bucket, packed first-fit into token_budget, order shuffled.

    Every piece appears in exactly one buffer; each buffer holds at most token_budget tokens (the rest is padding).
    Deterministic from (seed, epoch): `random.Random` seeded with a string is stable across Python runs.
    """
    if token_budget < max_len:
        raise ValueError(f"token_budget ({token_budget}) must be at least max_len ({max_len})")
    rng = random.Random(f"dflash-schedule:{seed}:{epoch}")
    buckets: list[list[Piece]] = [[] for _ in range(num_buckets)]
    for p in pieces:
        buckets[min(num_buckets - 1, (p[2] - 1) * num_buckets // max_len)].append(p)
    buffers: list[list[Piece]] = []
    # Open buffers persist across buckets, so short pieces fill what long ones left; the list is capped so packing
    # stays linear on millions of pieces (the oldest open buffer is closed first).
    open_bufs: list[list[Any]] = []  # [free tokens, pieces]
    for bucket in reversed(buckets):  # longest first: first-fit decreasing by bucket
        rng.shuffle(bucket)
        for p in bucket:
            for slot in open_bufs:
                if p[2] <= slot[0]:
                    slot[1].append(p)
                    slot[0] -= p[2]
                    break
            else:
                buf = [p]
                buffers.append(buf)
                open_bufs.append([token_budget - p[2], buf])
                if len(open_bufs) > _MAX_OPEN:
                    open_bufs.pop(0)
            open_bufs = [slot for slot in open_bufs if slot[0] >= 2]
    rng.shuffle(buffers)
    return buffers


@dataclass
class Schedule:
    """The buffers of every epoch, identical on every rank, persisted as JSON next to the run."""

    epochs: list[list[list[Piece]]]
    fingerprint: str
    seed: int
    token_budget: int

    def buffers_per_epoch(self) -> list[int]:
        return [len(e) for e in self.epochs]

    def buffer(self, key: tuple[int, int]) -> list[Piece]:
        return self.epochs[key[0]][key[1]]


def schedule_meta(corpus: TokenizedCorpus, cfg: DataConfig, seed: int) -> dict[str, Any]:
    """Everything the buffers depend on; the number of epochs is not part of it (epoch e is built alone)."""
    return {"fingerprint": corpus.fingerprint, "seed": seed, "token_budget": cfg.token_budget,
            "max_len": cfg.max_len, "min_len": cfg.min_len, "num_buckets": cfg.num_buckets}


def build_schedule(corpus: TokenizedCorpus, cfg: DataConfig, seed: int, epochs: int,
                   first: int = 0) -> Schedule:
    """Epochs first..epochs-1 (each depends only on seed and its own index)."""
    pieces = make_pieces(corpus.lengths(), cfg.max_len, cfg.min_len)
    if not pieces:
        raise DataError(f"data: no document piece has at least data.min_len={cfg.min_len} tokens")
    eps = [pack_epoch(pieces, cfg.token_budget, cfg.max_len, cfg.num_buckets, seed, e) for e in range(first, epochs)]
    return Schedule(epochs=eps, fingerprint=corpus.fingerprint, seed=seed, token_budget=cfg.token_budget)


def save_schedule(schedule: Schedule, meta: dict[str, Any], path: str | Path) -> None:
    """Atomic write (temp + fsync + rename): a crash never leaves a half schedule for the resume to trust."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    data = json.dumps({"meta": meta, "epochs": schedule.epochs}, separators=(",", ":")).encode()
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)


def schedule_mismatch(on_disk: dict[str, Any], now: dict[str, Any], hints: Sequence[str] = ()) -> str:
    """Say what differs between the schedule on disk and this run, and the ways out (the checkpoints stay valid);
    `hints` name likely causes of a changed fingerprint (rendering_hints)."""
    parts = []
    for k in sorted(set(now) | set(on_disk)):
        if on_disk.get(k) == now.get(k):
            continue
        if k == "fingerprint":
            parts.append(f"the corpus or tokenizer content (fingerprint {str(on_disk.get(k))[:12]} on disk, "
                         f"{str(now.get(k))[:12]} now)" + "".join(f"; likely: {h}" for h in hints))
        else:
            name = "train.seed" if k == "seed" else f"data.{k}"
            parts.append(f"{name} {on_disk.get(k)!r} on disk, {now.get(k)!r} now")
    return ("schedule was made for other data/settings: " + "; ".join(parts) + ". To resume, restore the original "
            "data and settings; to start a new run instead, pass --fresh or use another --out")


def load_or_build_schedule(corpus: TokenizedCorpus, cfg: DataConfig, seed: int, epochs: int,
                           path: str | Path, write: bool = True) -> Schedule:
    """Reuse the schedule on disk when it was made for this data and settings (extending it if the run got longer).

    A schedule on disk for different data is an error, not silently replaced: a resume would otherwise continue on
    different buffers than the checkpoint was trained on.
    """
    meta = schedule_meta(corpus, cfg, seed)
    p = Path(path)
    if not p.is_file():
        sched = build_schedule(corpus, cfg, seed, epochs)
        if write:
            save_schedule(sched, meta, p)
        return sched
    try:
        obj = json.loads(p.read_text())
        on_disk = obj["meta"]
        eps: list[list[list[Piece]]] = [[[(int(a), int(b), int(c)) for a, b, c in buf] for buf in ep]
                                        for ep in obj["epochs"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{p}: unreadable schedule ({exc}); delete it to rebuild") from None
    if on_disk != meta:
        raise DataError(f"{p}: {schedule_mismatch(on_disk, meta, corpus.hints)}")
    sched = Schedule(epochs=eps, fingerprint=corpus.fingerprint, seed=seed, token_budget=cfg.token_budget)
    if len(eps) < epochs:
        sched.epochs += build_schedule(corpus, cfg, seed, epochs, first=len(eps)).epochs
        if write:
            save_schedule(sched, meta, p)
    return sched


def buffer_arrays(corpus: TokenizedCorpus, pieces: Sequence[Piece], token_budget: int) -> dict[str, torch.Tensor]:
    """The packed token view of one buffer (fixed length token_budget): ids, loss mask, positions, doc ids (-1 = pad)."""
    import torch

    ids = torch.zeros(token_budget, dtype=torch.long)
    mask = torch.zeros(token_budget, dtype=torch.bool)
    pos = torch.zeros(token_budget, dtype=torch.long)
    doc = torch.full((token_budget,), -1, dtype=torch.long)
    o = 0
    for j, (d, s, n) in enumerate(pieces):
        ids[o:o + n] = corpus.ids[d][s:s + n]
        mask[o:o + n] = corpus.loss_mask[d][s:s + n]
        pos[o:o + n] = torch.arange(n)
        doc[o:o + n] = j
        o += n
    if o > token_budget:
        raise ValueError(f"buffer holds {o} tokens, more than token_budget={token_budget}")
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos, "doc_ids": doc}


def buffer_rows(corpus: TokenizedCorpus, pieces: Sequence[Piece], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded view of one buffer for a target without varlen: [R, T] right-padded ids and attention mask."""
    import torch

    t = max(n for _, _, n in pieces)
    ids = torch.full((len(pieces), t), pad_id, dtype=torch.long)
    att = torch.zeros((len(pieces), t), dtype=torch.long)
    for r, (d, s, n) in enumerate(pieces):
        ids[r, :n] = corpus.ids[d][s:s + n]
        att[r, :n] = 1
    return ids, att
