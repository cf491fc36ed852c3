"""dflash/yamlfile.py reads with libyaml's parser where PyYAML has it (~5x faster node tree on big files) and keeps
the pure-Python parser's words and lines for errors: both must give the same data, key lines and messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dflash import yamlfile

ROOT = Path(__file__).resolve().parents[1]
needs_libyaml = pytest.mark.skipif(not yaml.__with_libyaml__, reason="this PyYAML was built without libyaml")


def _python_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yamlfile, "_CLoader", None)


@needs_libyaml
def test_the_libyaml_parser_is_used_and_reads_every_shipped_file_as_the_python_one_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert yamlfile._CLoader is not None and issubclass(yamlfile._CLoader, yaml.CSafeLoader)
    files = sorted(ROOT.glob("configs/*.yaml")) + sorted(ROOT.glob("bench/*.yaml")) + [ROOT / "hosts.yaml"]
    texts = {f: f.read_text() for f in files}
    texts[Path("floats-and-anchors")] = ("a: 3e-4\nb: 1e6\nc: .inf\nd: 1_000\ne: '3e-4'\nbase: &b {x: [1, 2], y: no}\n"
                                         "f: {<<: *b, y: yes}\ng: *b\n")
    fast = {f: yamlfile.parse(t, str(f)) for f, t in texts.items()}
    _python_only(monkeypatch)
    for f, t in texts.items():
        slow = yamlfile.parse(t, str(f))
        assert fast[f].data == slow.data and fast[f].lines == slow.lines, f
    d = fast[Path("floats-and-anchors")].data
    assert d["a"] == 3e-4 and d["b"] == 1e6 and d["e"] == "3e-4" and d["f"] == {"x": [1, 2], "y": True}


@needs_libyaml
@pytest.mark.parametrize("text", [
    "a: [1, 2\nb: 3\n",                   # unclosed flow sequence
    "a: 'unterminated\nb: 2\n",            # unclosed quote
    "a: 1\nb c\nd: 2\n",                   # a key without its ':'
    "a: 1\n  b: 2\n",                      # mapping values are not allowed here
    "a: *nowhere\n",                       # an alias without its anchor
    "a: 1\n---\nb: 2\n",                   # two documents
    "a: !!python/object:os.system x\n",    # a tag SafeLoader refuses
])
def test_an_invalid_file_gets_the_python_parser_s_message_and_line(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(yamlfile.YamlFileError) as fast:
        yamlfile.parse(text, "f.yaml")
    _python_only(monkeypatch)
    with pytest.raises(yamlfile.YamlFileError) as slow:
        yamlfile.parse(text, "f.yaml")
    assert str(fast.value) == str(slow.value) and str(fast.value).startswith("f.yaml:")


@needs_libyaml
def test_aliases_are_capped_and_a_recursive_document_refused_on_the_libyaml_path() -> None:
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg", strict=True))
    with pytest.raises(yamlfile.YamlFileError, match="MAX_ALIAS_NODES"):
        yamlfile.parse(laughs, "laughs.yaml")
    with pytest.raises(yamlfile.YamlFileError, match="a recursive document"):
        yamlfile.parse("hosts: &h {local: {runs: {r: *h}}}\n", "loop.yaml")


@pytest.mark.parametrize("parser", ["libyaml", "python"])
def test_a_merge_whose_mapping_overrides_a_key_is_not_a_duplicate_but_a_key_written_twice_is(
        parser: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`<<: *defaults` plus an override is how a hosts.yaml shares run settings; constructing the merge rewrites the
    node in place, and the duplicate-key check used to read it afterwards ("f.y: duplicate key")."""
    if parser == "python":
        _python_only(monkeypatch)
    elif not yaml.__with_libyaml__:
        pytest.skip("this PyYAML was built without libyaml")
    text = ("defaults: &d\n  workdir: /w\n  ready_timeout: 60\nruns:\n  a:\n    <<: *d\n    ready_timeout: 300\n"
            "  b: {<<: *d}\n")
    doc = yamlfile.parse(text, "hosts.yaml")
    assert doc.data["runs"] == {"a": {"workdir": "/w", "ready_timeout": 300}, "b": {"workdir": "/w", "ready_timeout": 60}}
    assert doc.line_for(("runs", "a", "ready_timeout")) == 7 and doc.line_for(("runs", "a", "workdir")) == 5
    with pytest.raises(yamlfile.YamlFileError) as exc:
        yamlfile.parse(text + "  c:\n    x: 1\n    x: 2\n", "hosts.yaml")
    assert str(exc.value) == "hosts.yaml:11: runs.c.x: duplicate key"
