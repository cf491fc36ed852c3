"""The one YAML reader of both config loaders (dflash run configs, opsctl hosts.yaml): data plus the line of every key.

Stdlib + PyYAML only, so opsctl can import it without torch; every problem it raises is `FILE:LINE: field.path: what`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

Loc = tuple[str, ...]

# A config or hosts.yaml is a page or two of text; these caps make a hostile or mistaken file (a 516-byte
# "billion laughs", a log passed as --config) a one-line refusal in well under a second instead of gigabytes.
MAX_CONFIG_BYTES = 1 << 20  # the largest file either loader reads
MAX_ALIAS_NODES = 100_000  # the most nodes aliases (`*name`, `<<: *name`) may add to a document when expanded


class YamlFileError(ValueError):
    """Problems with one file; str() is one `FILE:LINE: field.path: message` line per problem."""

    def __init__(self, file: str, problems: list[tuple[int | None, str, str]]) -> None:
        self.file = file
        self.problems = problems  # (line or None, dotted field path or "", message)
        super().__init__("\n".join(format_problem(file, *p) for p in problems))


def format_problem(file: str, line: int | None, path: str, msg: str) -> str:
    """The single spelling of a config problem, shared so both CLIs print the same shape."""
    where = f"{file}:{line}" if line is not None else file
    return f"{where}: {path}: {msg}" if path else f"{where}: {msg}"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats: YAML 1.1 reads `3e-4` and `1e6` (no dot) as strings, ML configs do not."""


_FLOAT = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != _FLOAT] for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:
     [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


# libyaml's parser (PyYAML's C extension, shipped in its wheels) builds the node tree ~5x faster than the pure-Python
# one: a dense file at the size cap reads in 1.94 s instead of 6.65 s (bench/yaml_parse.py, docs/perf.md); the
# constructor and the resolvers above stay PyYAML's Python classes, so the data is the same. Errors are re-read with
# the Python parser, whose messages and marks the error lines below expect.
_CLoader: type[yaml.SafeLoader] | None = None
if getattr(yaml, "__with_libyaml__", False):
    class _CLoader(yaml.CSafeLoader):  # type: ignore[no-redef]
        """CSafeLoader with the YAML 1.2 floats of _Loader."""

    _CLoader.yaml_implicit_resolvers = _Loader.yaml_implicit_resolvers


@dataclass
class YamlDoc:
    """A parsed file: `data` as plain Python values, `lines` maps key paths ("a", "b", "0") to 1-based lines."""

    file: str
    data: Any
    lines: dict[Loc, int]

    def line_for(self, loc: Iterable[Any]) -> int | None:
        """The line of `loc`, or of its nearest ancestor that is in the file (a missing key points at its parent)."""
        return line_for(self.lines, tuple(str(p) for p in loc))

    def error(self, problems: list[tuple[Loc | str, str]]) -> YamlFileError:
        """A YamlFileError for (location, message) pairs; a location is a key path tuple or a dotted string."""
        out = []
        for loc, msg in problems:
            parts = tuple(loc.split(".")) if isinstance(loc, str) and loc else tuple(loc) if loc else ()
            out.append((self.line_for(parts), ".".join(parts), msg))
        return YamlFileError(self.file, out)


def line_for(lines: Mapping[Loc, int], loc: Loc) -> int | None:
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return None


def decode(raw: bytes, file: str) -> str:
    """UTF-8 text of a config file's bytes; anything else is one YamlFileError line (with its line), never a traceback.

    Reading is left to the callers: each CLI phrases a missing file in its own words.
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise YamlFileError(file, [(line, "", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                                              "save the file as UTF-8")]) from None


def read_bytes(path: str | os.PathLike[str], file: str) -> bytes:
    """The bytes of a config file, refused past MAX_CONFIG_BYTES without reading more than that (a FIFO, /dev/zero
    or a 50 MB file named by mistake costs nothing). OSError is left to the callers, who phrase it themselves."""
    with open(path, "rb") as fh:
        raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            try:
                size = f"{os.fstat(fh.fileno()).st_size / 1e6:.1f} MB, "
            except OSError:
                size = ""
            raise YamlFileError(file, [(None, "", _too_big(size))])
    return raw


def _too_big(size: str) -> str:
    return (f"{size}over the {MAX_CONFIG_BYTES} byte cap on config files (MAX_CONFIG_BYTES in dflash/yamlfile.py); "
            "is this the file you meant?")


def parse(text: str, file: str) -> YamlDoc:
    """Parse one YAML document from a single node tree, so data and line numbers can never disagree.

    Capped (MAX_CONFIG_BYTES, MAX_ALIAS_NODES) before anything is built: aliases are shared in the node tree, but the
    line walk below and every consumer of the data (pydantic, JSON dumps) expand them."""
    if len(text) > MAX_CONFIG_BYTES:  # characters <= bytes: a text this long is a file over the cap
        raise YamlFileError(file, [(None, "", _too_big(f"{len(text)} characters, "))])
    try:
        try:
            lines, data = _load(text, file, _CLoader or _Loader)
        except yaml.YAMLError:
            if _CLoader is None:
                raise
            lines, data = _load(text, file, _Loader)  # raises again, in the Python parser's words and lines
    except yaml.YAMLError as exc:
        raise YamlFileError(file, [(_error_line(text, exc), "", f"not valid YAML: {_error_text(exc)}")]) from None
    except RecursionError:
        raise _too_deep(file) from None
    return YamlDoc(file=file, data=data, lines=lines)


def _load(text: str, file: str, loader_cls: type[yaml.SafeLoader]) -> tuple[dict[Loc, int], Any]:
    """Node tree, then the key lines, then the data. The lines are read before construction because constructing a
    merge (`<<: *defaults`) rewrites the mapping node in place: walked afterwards, a key the merge brings in and the
    mapping overrides looked like a duplicate key."""
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, None
        _check_aliases(node, file)
        lines = _key_lines(node, file)
        return lines, loader.construct_document(node)
    finally:
        loader.dispose()


def _key_lines(node: yaml.Node, file: str) -> dict[Loc, int]:
    """Every key path's line as written; a key written twice in one mapping is refused at its second line."""
    lines: dict[Loc, int] = {(): node.start_mark.line + 1}
    dups: list[tuple[int | None, str, str]] = []

    def walk(n: yaml.Node, path: Loc) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                key = str(k.value)
                if key in seen:
                    dups.append((k.start_mark.line + 1, ".".join((*path, key)), "duplicate key"))
                seen.add(key)
                lines[(*path, key)] = k.start_mark.line + 1
                walk(v, (*path, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                lines[(*path, str(i))] = item.start_mark.line + 1
                walk(item, (*path, str(i)))

    walk(node, ())
    if dups:
        raise YamlFileError(file, dups)
    return lines


def _too_deep(file: str) -> YamlFileError:
    return YamlFileError(file, [(None, "", "nested too deeply to read (lists or mappings inside each other hundreds "
                                           "of levels deep)")])


def _check_aliases(root: yaml.Node, file: str) -> None:
    """Refuse a document whose aliases expand it by more than MAX_ALIAS_NODES nodes, or that contains itself.

    Sizes are memoized per node, so this costs one visit per node as written, never per node as expanded."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    written = 0

    def expanded(n: yaml.Node) -> int:
        nonlocal written
        key = id(n)
        if key in size:
            return size[key]
        if key in on_path:
            raise YamlFileError(file, [(n.start_mark.line + 1, "", "an alias refers to a list or mapping that "
                                                                   "contains it (a recursive document)")])
        on_path.add(key)
        written += 1
        total = 1
        if isinstance(n, yaml.MappingNode):
            total += sum(expanded(k) + expanded(v) for k, v in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total += sum(expanded(item) for item in n.value)
        on_path.discard(key)
        size[key] = total
        if total - written > MAX_ALIAS_NODES:
            raise YamlFileError(file, [(n.start_mark.line + 1, "", f"aliases expand this document by more than "
                                        f"{MAX_ALIAS_NODES} nodes (MAX_ALIAS_NODES in dflash/yamlfile.py; a "
                                        "'billion laughs'?); write the values out or use fewer nested aliases")])
        return total

    expanded(root)


_UNCLOSED = {"while parsing a flow sequence": "a '[' list", "while parsing a flow mapping": "a '{' mapping",
             "while scanning a quoted scalar": "a quoted string"}


def _error_text(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    if context in _UNCLOSED:
        return f"{problem} ({_UNCLOSED[context]} opened on this line is not closed)"
    return str(problem)


def _error_line(text: str, exc: yaml.YAMLError) -> int | None:
    """The line a person has to fix. PyYAML reports where it noticed the problem, which is often the line after it:
    an unclosed bracket or quote is noticed at the next line or at the end; a key missing its ':' runs into the next
    line's key, whose ':' is then reported."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return None
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if (context in _UNCLOSED or context == "while scanning a simple key") and context_mark is not None:
        return context_mark.line + 1  # where the unclosed thing, or the key without its ':', starts
    if getattr(exc, "problem", None) == "mapping values are not allowed here":
        start = _last_scalar_start(text)
        if start is not None and start < mark.line:
            return start + 1
    if not text[mark.index:].strip(" \t\r\n") or _only_comments(text[mark.index:]):
        # the file ended inside something unfinished: the problem is on the last line with content
        content = [i for i, ln in enumerate(text[: mark.index].splitlines()) if ln.strip() and
                   not ln.strip().startswith("#")]
        if content:
            return content[-1] + 1
    return mark.line + 1


def _only_comments(rest: str) -> bool:
    return all(not ln.strip() or ln.strip().startswith("#") for ln in rest.splitlines())


def _last_scalar_start(text: str) -> int | None:
    """0-based line where the last scalar token before a scanner error starts (PyYAML scans lazily, so the tokens
    before the error come out before it is raised)."""
    start = None
    try:
        for tok in yaml.scan(text, Loader=_Loader):
            if isinstance(tok, yaml.ScalarToken):
                start = tok.start_mark.line
    except yaml.YAMLError:
        pass
    return start
