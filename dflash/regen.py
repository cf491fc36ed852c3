"""`dflash regen`: the target writes the drafter's training data: its own continuations of the corpus prompts, kept as
token ids, with a loss mask that supervises exactly the target-generated tokens.

DFlash drafters must agree with their target, not with the data: trained on the target's own outputs they learn what
the verifier will accept. Output: DATA_DIR/regen.jsonl (one record per prompt, appended and fsync'd one at a time, so a
killed run resumes without losing or repeating a prompt) and DATA_DIR/regen.json (the manifest: the tokenizer the ids
belong to, saved alongside, and the target that made them). `dflash train` reads DATA_DIR as `data.paths`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash import locks
from dflash.cache_entry import content_problem, record_content, structure_problem, target_identity
from dflash.config import ConfigError, RunConfig
from dflash.data import REGEN_MANIFEST, DataError, Document, TokenizerAdapter, corpus_fingerprint, load_tokenizer
from dflash.evalprogress import isatty
from dflash.pretrain import as_dict, replace_fields

RECORDS = "regen.jsonl"
_FORMAT = 1
Log = Callable[[str], None]


@dataclass
class Prompt:
    """One generation job: a stable id (document index and where in it), and the prompt's token ids."""

    id: str
    ids: list[int]


@dataclass
class RegenSettings:
    max_new_tokens: int | None = None  # None -> data.max_len - prompt_tokens (a record fits one training piece)
    temperature: float = 0.0  # 0 = greedy (the target's own greedy continuation)
    prompt_tokens: int | None = None  # text prompts; None -> data.max_len // 4
    num_prompts: int | None = None  # cap: N prompts spread evenly over the corpus (in corpus order); None = all
    batch_size: int = 128  # prompts per forward (CPU decode cost is per step, nearly flat in the batch)
    seed: int = 0

    def resolved(self, max_len: int) -> RegenSettings:
        p = self.prompt_tokens or max(1, max_len // 4)
        n = self.max_new_tokens if self.max_new_tokens is not None else max(1, max_len - p)
        return dataclasses.replace(self, prompt_tokens=p, max_new_tokens=n)

    def check(self) -> None:
        for name in ("max_new_tokens", "prompt_tokens", "num_prompts", "batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")


def corpus_prompts(docs: Sequence[Document], tok: TokenizerAdapter, prompt_tokens: int, stride: int) -> list[Prompt]:
    """Every prompt of the corpus, in corpus order.

    Text: the first `prompt_tokens` tokens of every `stride`-token piece (stride = data.max_len, the way training cuts
    pieces) that has text after them; the target continues each. Chat: for each assistant turn, the conversation up
    to that turn's header (earlier turns as written), rendered as training renders it (the record's tools, and
    data.thinking's switch: TokenizerAdapter.chat_prompt); the target writes the reply. Token records are skipped
    (they are already generated).
    """
    out: list[Prompt] = []
    text_idx = [i for i, d in enumerate(docs) if d.text is not None]
    encoded = dict(zip(text_idx, tok.encode_batch([docs[i].text or "" for i in text_idx]), strict=True))
    for i, d in enumerate(docs):
        if d.text is not None:
            ids = encoded[i]
            out += [Prompt(f"{i}:{s}", ids[s:s + prompt_tokens]) for s in range(0, len(ids), stride)
                    if len(ids) - s > prompt_tokens]
        elif d.messages is not None:
            for t, m in enumerate(d.messages):
                if m["role"] == "assistant" and t > 0:
                    out.append(Prompt(f"{i}:turn{t}", tok.chat_prompt(d.messages[:t], d.tools)))
    return out


def prompt_rendering(tok: TokenizerAdapter, docs: Sequence[Document]) -> dict[str, str]:
    """How chat prompts are rendered, beyond the corpus and the tokenizer's content, where it makes them unlike
    regen's prompts before it rendered chats as training does (no tools, the template's default thinking mode, tool
    calls handed to a template that ignores them): named in regen's cache key and manifest, and in the held-out
    set's key, so records made with the other rendering are never reused, while data it does not change keeps its
    key (empty for text corpora, and for chats without tools under a template without a thinking switch)."""
    chats = [d for d in docs if d.messages is not None]
    out: dict[str, str] = {}
    if not chats:
        return out
    if any(d.tools for d in chats):
        out["tools"] = "rendered"
    if tok.thinking_switch_renders():
        out["thinking"] = tok.thinking
    if tok._hf is not None and any(m.get("tool_calls") for d in chats for m in d.messages or []) \
            and not tok._renders_tool_calls():
        out["tool_calls"] = "text"
    return out


def spread(prompts: Sequence[Prompt], num: int) -> list[Prompt]:
    """`num` prompts evenly spaced over all of them, in corpus order (all when there are no more than `num`).

    Why not the first N: corpora are read in file-name order, so the first N prompts come from a handful of files and
    a drafter trained on their continuations learns those files instead of the target (measured on the H200 bench:
    1536 leading prompts, training accuracy 64 % at block position 1 vs 22 % on held-out text).
    """
    n = len(prompts)
    if num >= n:
        return list(prompts)
    return [prompts[(i * n) // num] for i in range(num)]


def _done_ids(records: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off so appending continues cleanly."""
    if not records.is_file():
        return set()
    data = records.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(records, "r+b") as fh:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())
    done = set()
    for n, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{records}:{n}: not a regen record; use another --out") from None
    return done


def _cut(gen: list[int], stop: set[int]) -> tuple[list[int], str]:
    """The generated tokens up to and including the first stop token (the loop runs on for the other rows)."""
    for j, t in enumerate(gen):
        if t in stop:
            return gen[: j + 1], "stop"
    return gen, "length"


CUDA_GRID_Y_MAX = 65535  # CUDA's limit on a launch grid's y (and z) dimension


def cuda_rows_cap(config: Any) -> int:
    """The most prompts one forward may carry on CUDA. fla's Gated DeltaNet kernels launch grids of
    (chunks, batch x value heads); past 65,535 rows a launch fails with "Triton Error [CUDA]: invalid argument"
    (seen on an H200: 4096 prompts x 16 heads). Full attention's heads are counted too, to stay clear of the same
    limit in any kernel that lays out (batch x heads) on y."""
    cfg = getattr(config, "text_config", None) or config
    heads = max(int(getattr(cfg, "linear_num_value_heads", 0) or 0), int(getattr(cfg, "num_attention_heads", 0) or 0),
                1)
    return max(1, CUDA_GRID_Y_MAX // heads)


def generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float, stop: list[int],
                   device: torch.device, generator: torch.Generator | None = None) -> list[tuple[list[int], str]]:
    """Continue equally long prompts together (no padding: every row is exactly the target's own continuation).

    A plain cached decode loop (one prefill, then one token per forward; greedy, or sampling at `temperature`),
    several times faster on CPU than `generate()` with its per-step bookkeeping. Stops when every row has produced a
    stop token or `max_new_tokens`.
    """
    x = torch.tensor(prompts, dtype=torch.long, device=device)
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.x renamed it
    stop_t = torch.tensor(stop, dtype=torch.long, device=device)
    done = torch.zeros(x.shape[0], dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []
    with torch.no_grad():
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        for i in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            steps.append(nxt)
            done |= torch.isin(nxt, stop_t)
            if bool(done.all()) or i + 1 == max_new_tokens:
                break
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            out = model(input_ids=nxt[:, None], use_cache=True, **{cache_kw: cache})
    gen = torch.stack(steps, dim=1).tolist()
    return [_cut(row, set(stop)) for row in gen]


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    tmp = out / f".{REGEN_MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / REGEN_MANIFEST)


def regen(cfg: RunConfig, docs: Sequence[Document], out: str | Path, settings: RegenSettings, *,
          device: torch.device | None = None, log: Log = print, max_seconds: float | None = None) -> dict[str, Any]:
    """_regen into `out` holding its lock (`.NAME.lock` next to it): two regens appending to one regen.jsonl would
    interleave and repeat prompts, so the second is refused naming the first (locks.LockBusy). The cache build
    (regenerated_documents) holds it already (re-entrant)."""
    dst = Path(out)
    with locks.hold(locks.sibling_lock(dst), str(dst), hint="another dflash regen writes there: wait for it to end "
                    "(rerunning it later resumes), or use another --out"):
        return _regen(cfg, docs, dst, settings, device=device, log=log, max_seconds=max_seconds)


def _regen(cfg: RunConfig, docs: Sequence[Document], out: str | Path, settings: RegenSettings, *,
           device: torch.device | None = None, log: Log = print, max_seconds: float | None = None) -> dict[str, Any]:
    """Run the config's target over the corpus prompts and append records to OUT/regen.jsonl (resumable).

    `max_seconds` stops after the batch that crosses it (a time-boxed benchmark); the records so far are complete
    and the same call later continues with the rest.

    `cfg` must already name its target (dflash.pretrain.resolve_target has run). Returns a summary.
    """
    from dflash.target import Target, hf_progress_bars, use_sdpa_for_decoding

    settings.check()
    s = settings.resolved(cfg.data.max_len)
    assert s.prompt_tokens is not None and s.max_new_tokens is not None
    dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dst = Path(out)
    if any(d.ids is not None for d in docs):
        raise DataError(f"{cfg.source}: data.paths holds token records already; regen reads text or chat corpora")
    cache = Path(cfg.data.tokenizer_cache) if cfg.data.tokenizer_cache else dst / "tokenizer-cache"
    tok = load_tokenizer(cfg.data, docs, cache)
    manifest = {
        "format": _FORMAT,
        "tokenizer": {"kind": "tiny" if getattr(tok, "_tiny", None) is not None else "hf", "path": "tokenizer",
                      "content_hash": tok.content_hash, "vocab_size": tok.vocab_size},
        "target": {"path": cfg.target.path, "arch": None if cfg.target.path else cfg.target.arch,
                   "seed": cfg.target.seed},
        "settings": dataclasses.asdict(s),
        **({"rendering": r} if (r := prompt_rendering(tok, docs)) else {}),
        "source": {"config": cfg.source, "corpus_fingerprint": corpus_fingerprint(docs),
                   "data": as_dict(cfg.data)},
    }
    old = dst / REGEN_MANIFEST
    if old.is_file():
        on_disk = json.loads(old.read_text())
        keys = ("format", "tokenizer", "target", "settings", "rendering")
        differ = [{"rendering": "chat rendering (tools, data.thinking)"}.get(k, k) for k in keys
                  if on_disk.get(k) != manifest.get(k)]
        if on_disk.get("source", {}).get("corpus_fingerprint") != manifest["source"]["corpus_fingerprint"]:
            differ.append("corpus")
        if differ:
            raise DataError(f"{old}: records in {dst} were made with another {', '.join(differ)}; "
                            "use another --out (or delete it) to regenerate")
    elif dst.exists() and any(p.name != "tokenizer-cache" for p in dst.iterdir()):
        raise DataError(f"{dst}: exists and holds no {REGEN_MANIFEST}; use an empty or new --out")
    dst.mkdir(parents=True, exist_ok=True)
    if not old.is_file():
        entry = tok.save(dst / "tokenizer")
        assert entry["content_hash"] == tok.content_hash
        _write_manifest(dst, manifest)

    prompts = corpus_prompts(docs, tok, s.prompt_tokens, cfg.data.max_len)
    if s.num_prompts is not None:
        prompts = spread(prompts, s.num_prompts)
    if not prompts:
        raise DataError(f"{cfg.source}: no prompt of more than {s.prompt_tokens} tokens in the corpus")
    records = dst / RECORDS
    done = _done_ids(records)
    todo = [p for p in prompts if p.id not in done]
    log(f"regen: {len(prompts)} prompts ({len(done & {p.id for p in prompts})} already done), up to "
        f"{s.max_new_tokens} new tokens each, temperature {s.temperature}, into {records}")
    if not todo:
        return {"prompts": len(prompts), "written": 0, "records": str(records), "new_tokens": 0, "complete": True}

    tcfg = cfg.target if cfg.target.path else \
        replace_fields(cfg.target, arch={**cfg.target.arch, "vocab_size": tok.vocab_size})
    t0 = time.perf_counter()
    with hf_progress_bars(isatty(sys.stderr)):  # a pipe or a log gets the line below, not a `\r` bar
        target = Target(tcfg, 1, dev)
    log(f"regen: target {tcfg.path or 'random init (target.arch)'} loaded in {time.perf_counter() - t0:.1f} s")
    if target.vocab_size < tok.vocab_size:
        raise DataError(f"target vocab {target.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    model = target.model
    use_sdpa_for_decoding(model)  # batched cached decoding: transformers' masks, not the packed-row varlen function
    if dev.type == "cuda" and s.batch_size > (cap := cuda_rows_cap(model.config)):
        log(f"regen: --batch-size {s.batch_size} lowered to {cap}: the target's kernels launch one CUDA block row per "
            f"prompt and head, and a grid's y dimension holds at most {CUDA_GRID_Y_MAX}")
        s = dataclasses.replace(s, batch_size=cap)
    stop = tok.stop_ids()
    # Equal lengths batch together (text prompts all have prompt_tokens), longest first; order within is corpus order.
    order = sorted(range(len(todo)), key=lambda j: (-len(todo[j].ids), j))
    batches: list[list[Prompt]] = []
    for j in order:
        p = todo[j]
        if batches and len(batches[-1]) < s.batch_size and len(batches[-1][0].ids) == len(p.ids):
            batches[-1].append(p)
        else:
            batches.append([p])
    t0 = time.perf_counter()
    written = new_tokens = 0
    bar = _progress(len(todo))
    next_log = 0.0
    with open(records, "a", encoding="utf-8") as fh:
        for b, batch in enumerate(batches):
            gen = None
            if s.temperature > 0:  # sampling: one seed per batch, from the settings and the batch's first prompt
                gen = torch.Generator(device=dev)
                gen.manual_seed(int(hashlib.sha256(f"{s.seed}:{batch[0].id}".encode()).hexdigest()[:8], 16))
            outs = generate_batch(model, [p.ids for p in batch], s.max_new_tokens, s.temperature, stop, dev, gen)
            for p, (gen, why) in zip(batch, outs, strict=True):
                rec = {"id": p.id, "input_ids": [*p.ids, *gen], "loss_mask": [0] * len(p.ids) + [1] * len(gen),
                       "prompt_tokens": len(p.ids), "end": why}
                fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
                written += 1
                new_tokens += len(gen)
            # One fsync per batch, not per record (a 1024-prompt GPU batch would pay 1024 of them); a kill still
            # loses nothing written (the page cache keeps it) and a torn last line is cut off on resume.
            fh.flush()
            os.fsync(fh.fileno())
            elapsed = time.perf_counter() - t0
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix_str(f"{new_tokens / max(elapsed, 1e-9):.0f} tok/s")
            if elapsed >= next_log or b + 1 == len(batches):
                next_log = elapsed + 10.0
                eta = elapsed / written * (len(todo) - written)
                log(f"regen: {written}/{len(todo)} prompts, {new_tokens} tokens, "
                    f"{new_tokens / max(elapsed, 1e-9):.0f} tok/s, eta {eta:.0f}s")
            if max_seconds is not None and elapsed >= max_seconds and b + 1 < len(batches):
                log(f"regen: time budget of {max_seconds:.0f}s reached after {written}/{len(todo)} prompts; "
                    "the same command continues where this stopped")
                break
    if bar is not None:
        bar.close()
    return {"prompts": len(prompts), "written": written, "records": str(records), "new_tokens": new_tokens,
            "seconds": round(time.perf_counter() - t0, 1), "complete": written == len(todo)}


def regen_key_fields(cfg: RunConfig, tok: TokenizerAdapter, docs: Sequence[Document],
                     settings: RegenSettings) -> dict[str, Any]:
    """Everything the regenerated records depend on, hashed into their cache entry's name; `rendering` only where
    prompt_rendering names something (so entries made before it existed keep their name when prompts are unchanged)."""
    fields: dict[str, Any] = {"format": _FORMAT, "target": target_identity(cfg.target), "tokenizer": tok.content_hash,
                              "corpus": corpus_fingerprint(docs),
                              "settings": dataclasses.asdict(settings.resolved(cfg.data.max_len))}
    if rendering := prompt_rendering(tok, docs):
        fields["rendering"] = rendering
    return fields


def cached_records_problem(out: Path) -> str | None:
    """None when a cached records directory is whole (cache_entry's content record). One of an older dflash (no
    record, but complete.json) is adopted when regen.jsonl holds as many records as complete.json says were made:
    a file cut at a line boundary parses fine and would train on part of the data."""
    problem = content_problem(out)
    if problem is None or not problem.endswith("no content record"):
        return problem
    complete = out / "complete.json"
    problem = structure_problem(out)
    if problem is not None:
        return problem
    try:
        promised = int(json.loads(complete.read_text())["prompts"])
        with open(out / RECORDS, "rb") as fh:
            found = sum(1 for line in fh if line.strip())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{out}: unreadable records or {complete.name} ({type(exc).__name__})"
    if found != promised:
        return f"{out / RECORDS}: {found} records, {complete} says {promised} were made"
    record_content(out)
    return None


def regenerated_documents(cfg: RunConfig, docs: Sequence[Document], log: Log = print) -> list[Document]:
    """The drafter's training documents under `target.regen`: the target's own continuations of `docs`' prompts,
    regenerated on first use into a cache directory (resumable: a killed first use continues where it stopped) and
    read back as token records. Without target.regen, or when `docs` already are records, `docs` unchanged.

    The config keeps naming the corpus (data.paths): it is what the records were made from, and where `dflash eval`
    finds its held-out prompts.
    """
    from dflash.data import read_documents
    from dflash.pretrain import cache_root
    from dflash.target import TargetPretrainConfig

    rc = getattr(cfg.target, "regen", None)
    if rc is None or any(d.ids is not None for d in docs):
        return list(docs)
    settings = RegenSettings(max_new_tokens=rc.max_new_tokens, temperature=rc.temperature,
                             prompt_tokens=rc.prompt_tokens, num_prompts=rc.num_prompts, batch_size=rc.batch_size)
    try:
        settings.check()
    except ConfigError as exc:
        raise ConfigError(f"{cfg.source}: target.regen: {str(exc).lstrip('-').replace('-', '_', 2)}") from None
    root = Path(rc.cache_dir).expanduser() if rc.cache_dir else cache_root(cfg.target.pretrain or TargetPretrainConfig())
    tok_cache = Path(cfg.data.tokenizer_cache) if cfg.data.tokenizer_cache else root / "tokenizer"
    tok = load_tokenizer(cfg.data, docs, tok_cache)
    blob = json.dumps(regen_key_fields(cfg, tok, docs, settings), sort_keys=True, default=str)
    out = root / f"regen-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    complete = out / "complete.json"
    # Two runs started at once on a fresh cache: the second waits for the first's records and then reuses them.
    with locks.hold(locks.sibling_lock(out), f"regen cache entry {out}", wait=True, log=log):
        problem = cached_records_problem(out) if complete.is_file() else "absent"
        if problem is None:
            log(f"data: the target's regenerated records {out} (cached)")
        else:
            if problem == "absent":  # a killed first use continues where it stopped (regen resumes)
                log(f"data: regenerating the training data with the target (first use; cached as {out})")
            else:
                log(f"data: cache entry {out} is damaged ({problem}): regenerating it")
                try:
                    shutil.rmtree(out)  # ours by name, inside the cache, and we hold its lock
                except OSError as exc:
                    raise DataError(f"{out}: damaged cache entry ({problem}) that cannot be removed "
                                    f"({exc.strerror}); delete it by hand") from None
            summary = regen(cfg, docs, out, settings, log=log)
            if summary["complete"]:
                complete.write_text(json.dumps(summary) + "\n")
                record_content(out)  # last: sizes + sha256 of every file, checked on each use
    from dflash.pretrain import replace_fields

    return read_documents(replace_fields(cfg.data, paths=[str(out)], format="auto"))


def _progress(total: int) -> Any:
    """A tqdm bar on an interactive terminal; log lines alone otherwise (files, tmux logs)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="regen", unit="prompt", file=sys.stderr)


__all__ = [
    "CUDA_GRID_Y_MAX", "Prompt", "RegenSettings", "corpus_prompts", "cuda_rows_cap", "generate_batch",
    "prompt_rendering", "regen", "regen_key_fields", "regenerated_documents", "spread",
]
