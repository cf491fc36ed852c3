"""The `dflash` command line: train, preflight and export, with help that shows how to use them.

Bad input (config, data, a corrupt checkpoint) prints one line naming the file and field and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

EPILOG = """\
examples:
  dflash train --config configs/tiny.yaml --out runs/tiny
      train the embedded tiny default on CPU (a couple of minutes); watch runs/tiny/train.log
      and runs/tiny/events.jsonl (the telemetry contract, docs/events.md)
  dflash train --config configs/tiny.yaml --out runs/tiny --resume --max-steps 400
      continue from the newest checkpoint in runs/tiny/checkpoints (refused if it is corrupt)
  dflash train --config configs/tiny.yaml --out runs/tiny --fresh
      start over in a directory that holds an older run's checkpoints
  dflash train --config my.yaml --out runs/adapted --init-from z-lab-Qwen3.5-27B-DFlash
      start from a released (or exported) drafter and train it on your data; refused unless its shapes,
      taps, block size and mask token match the config
  torchrun --nproc-per-node 8 -m dflash train --config my.yaml --out /runs/a
      one process per GPU; `dist: {roles: split, target_ranks: 5}` puts the target on 5 ranks
  dflash preflight --config my.yaml
      which kernels the target would use; exit 1 if a GPU run would fall back to slow PyTorch code
  dflash export --checkpoint runs/tiny/checkpoints/step-200 --out hf/tiny-drafter
      a Hugging Face directory in the DFlashDraftModel format (z-lab/dflash, SGLang, vLLM), bfloat16,
      published only if it passes the serving checks (docs/serving.md)
  dflash export --check hf/tiny-drafter --target /models/Qwen3.5-27B
      what SGLang or vLLM would misread in an export; exit 1 if anything

exit codes: 0 ok (also after SIGTERM/SIGINT: the step finishes and is checkpointed; before the first step
            the run stops at the next phase boundary), 1 run error (see events.jsonl),
            2 bad config/data/checkpoint (one line on stderr), 130/143 second signal
"""


class _Parser(argparse.ArgumentParser):
    """argparse's own usage error, also left in torchrun's error file: under torchrun a mistyped option would otherwise
    reach opsctl only as `exitcode 2` (subparsers are made with this class too)."""

    def error(self, message: str) -> NoReturn:
        from dflash import telemetry

        self.print_usage(sys.stderr)
        line = f"{self.prog}: error: {message}"
        print(line, file=sys.stderr, flush=True)
        telemetry.last_stderr_line = line
        _tell_torchrun(2)
        sys.exit(2)


def _wrap(text: str) -> str:
    """A description paragraph for a parser whose raw formatter keeps the epilog's examples as written."""
    import textwrap

    return textwrap.fill(text, 100)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dflash", description="Train DFlash speculative-decoding drafters.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    t = sub.add_parser("train", help="train (or resume) a drafter", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=_wrap("Train a DFlash drafter on a frozen target's hidden states: the config names the "
                                   "target (a local HF directory, or a random-init `target.arch`), the data, the "
                                   "drafter and the schedule; --out gets train.log, events.jsonl (docs/events.md) "
                                   "and verified checkpoints, and the drafter's exact tau is measured at each "
                                   "checkpoint (train.eval_every). The config is checked completely before torch "
                                   "loads. Under opsctl, `opsctl launch HOST RUN` runs this command in tmux and "
                                   "watches it."))
    t.add_argument("--config", required=True, help="run config YAML (see configs/tiny.yaml)")
    t.add_argument("--out", default=None, help="run directory (default runs/<config name>)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (overrides the config)")
    t.add_argument("--resume", nargs="?", const="always", choices=["always", "auto"], default=None,
                   help="continue from the newest checkpoint in --out (refused if it is corrupt); "
                        "`--resume auto`: resume if --out has a checkpoint, else start")
    t.add_argument("--fresh", action="store_true",
                   help="start over in an --out that has checkpoints (deletes OUT/checkpoints/step-*)")
    t.add_argument("--allow-slow-kernels", action="store_true",
                   help="run a GPU job even if the target falls back to slow PyTorch kernels")
    t.add_argument("--init-from", metavar="EXPORT_DIR", default=None,
                   help="start from a z-lab-layout drafter (a `dflash export`, a released DFlash drafter) instead "
                        "of a random init; its shapes, taps, block size and mask token must match the config "
                        "(train.init_from)")
    f = sub.add_parser("preflight", help="show the kernels a config's target binds; exit 1 on problems")
    f.add_argument("--config", required=True)
    f.add_argument("--allow-slow-kernels", action="store_true")
    e = sub.add_parser("export", help="checkpoint -> Hugging Face DFlashDraftModel directory; --check an export",
                       description=_wrap("Write a checkpoint as the DFlashDraftModel directory SGLang and vLLM "
                                         "load (checked before it is published), or --check an existing export "
                                         "directory."),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n"
                              "  dflash export --checkpoint runs/tiny/checkpoints/step-1200 --out hf/drafter\n"
                              "  dflash export --check hf/drafter --target /models/Qwen3.5-27B\n\n"
                              "exit codes: 0 written (or --check found nothing); 1 a loader check failed (one line "
                              "per problem; nothing published); 2 bad arguments or an unreadable checkpoint")
    e.add_argument("--checkpoint", help="a checkpoints/step-N directory")
    e.add_argument("--out", help="output directory (must not exist or be empty)")
    e.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="weight dtype of the export (default bfloat16, like released drafters)")
    e.add_argument("--check", metavar="DIR", help="only check an export directory: every SGLang/vLLM loader rule, "
                                                  "one line per problem, exit 1 if any")
    e.add_argument("--target", metavar="TARGET_DIR",
                   help="the target's Hugging Face directory: also check taps, vocabulary, hidden size against it")
    _eval_parser(sub)
    _data_parser(sub)
    pt = sub.add_parser("pretrain-target", help="train target.arch as a language model on the corpus -> HF dir",
                        description="Train the config's random-init target (target.arch, target.pretrain settings) "
                                    "as a language model on the config's corpus and save a Hugging Face directory "
                                    "(weights + tokenizer) for target.path. A config with target.pretrain does "
                                    "this by itself on first use and caches the result.")
    pt.add_argument("--config", required=True)
    pt.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    rg = sub.add_parser("regen", help="the target continues the corpus prompts -> training JSONL (data.paths)",
                        description="Run the config's target over its corpus prompts (text: a prefix; chat: the "
                                    "turns before each assistant reply) and write OUT/regen.jsonl: token ids as "
                                    "ids, loss_mask 1 on the target-generated tokens. Resumable: rerun the same "
                                    "command after a kill. Train on it with `data: {paths: [OUT]}`.")
    rg.add_argument("--config", required=True)
    rg.add_argument("--out", required=True, help="data directory (new, or one this command wrote: it resumes)")
    rg.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens generated per prompt (default: target.regen's, else data.max_len - prompt)")
    rg.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    rg.add_argument("--prompt-tokens", type=int, default=None, help="text prompt length (default: target.regen's, else data.max_len/4)")
    rg.add_argument("--num-prompts", type=int, default=None, help="at most N prompts, spread evenly over the corpus")
    rg.add_argument("--batch-size", type=int, default=None, help="prompts decoded together (default 128)")
    rg.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    return p


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    """`dflash eval`: greedy speculative decoding with the target verifying each block (dflash/eval.py)."""
    v = sub.add_parser("eval", help="acceptance length tau of a drafter on its target (lossless-checked), vs n-gram",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n"
                              "  dflash eval --checkpoint runs/tiny/checkpoints/step-1200 --baseline ngram\n"
                              "  dflash eval --checkpoint runs/tiny/checkpoints/step-1200 --method decode --json\n"
                              "  dflash eval --drafter hf/drafter --target /models/Qwen3.5-27B --prompts p.jsonl\n\n"
                              "exit codes: 0 measured (decode: every output equals the target's own greedy "
                              "decoding); 1 decode found an output that differs (not lossless); 2 bad arguments, "
                              "checkpoint, export or prompts (one line); 141 the reader closed the pipe",
                       description=_wrap("The acceptance length tau of greedy speculative decoding on held-out "
                                         "prompts (mean tokens committed per target verify forward), acceptance per "
                                         "block position next to the training-time accuracy. --method decode also "
                                         "measures speed and checks lossless: exit 1 if any output differs from the "
                                         "target's own greedy decoding."))
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a RUN/checkpoints/step-N directory")
    src.add_argument("--drafter", help="a `dflash export` directory")
    v.add_argument("--config", help="the run's config YAML (default: the one saved in the checkpoint)")
    v.add_argument("--target", help="a local Hugging Face target directory (default: the run's target)")
    v.add_argument("--prompts", help=".jsonl with text/messages per line, or a text file with one prompt per line "
                                     "(default: held-out documents of the run's corpus)")
    v.add_argument("--num-prompts", type=int, default=8)
    v.add_argument("--prompt-tokens", type=int, default=32, help="prompt length for held-out documents")
    v.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens decoded per prompt (default 64). --method teacher-forced takes prompt + new tokens "
                        "+ B-1 up to 2^26/B - B tokens (4,194,288 at B=16; more is refused in one line): its drafter "
                        "pass runs in anchor chunks of at most 2^26 mask elements (bounded memory), and its time "
                        "grows with new tokens x sequence length")
    v.add_argument("--block-size", type=int, default=None, help="draft block size B (default: the drafter's)")
    v.add_argument("--method", choices=["teacher-forced", "decode"], default=None,
                   help="teacher-forced (default for greedy): the decode loop's exact tau and acceptance per position "
                        "from the "
                        "target's greedy continuations, one target forward per prompt and one drafter pass over "
                        "every position: many times faster (no token-by-token loop), the same figures. decode: "
                        "greedy speculative decoding itself: adds wall-clock speed against the target alone and "
                        "the lossless check (exit 1 when an output differs from the target's own greedy decoding)")
    v.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy. T > 0: speculative sampling at T (--method decode, the default then): "
                        "drafts accepted with probability min(1, p/q), a rejection resampled from max(0, p - q); "
                        "lossless in distribution (tests/test_speculative_sampling.py), so no per-prompt check")
    v.add_argument("--draft", choices=["sample", "argmax"], default="sample",
                   help="with --temperature: DFlash drafts sampled from the drafter's softmax at T (sample, default) "
                        "or its greedy tokens (argmax)")
    v.add_argument("--seed", type=int, default=0, help="with --temperature: the sampling seed (per prompt streams)")
    v.add_argument("--baseline", choices=["ngram"], default=None, help="also run prompt-lookup drafting")
    v.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    v.add_argument("--no-stop", action="store_true", help="do not stop at the tokenizer's end-of-text token")
    v.add_argument("--tie-tol", type=float, default=None,
                   help="relative logit gap counted as a numerical tie, not a lossless failure "
                        "(default by the precision in effect: 1e-4 true float32, 3e-3 float32 on kernels that "
                        "multiply in TF32, 3e-2 bf16/fp16 or under bf16 autocast, as on a GPU)")
    v.add_argument("--json", action="store_true", help="print one JSON object")


def _data_parser(sub: argparse._SubParsersAction) -> None:
    """`dflash data inspect`: the corpus as training will see it, without the target (dflash/data_inspect.py)."""
    d = sub.add_parser("data", help="inspect training data (formats: docs/data.md)",
                       description="Look at training data before a run spends a GPU on it (docs/data.md).")
    dsub = d.add_subparsers(dest="data_cmd", required=True, metavar="ACTION")
    i = dsub.add_parser("inspect", help="documents, tokens, lengths, supervised share, drops, buffer fill, a sample",
                        description=_wrap("Read and tokenize the configured data (or DATA) without loading the "
                                          "target: documents, tokens, the length histogram against data.max_len and "
                                          "data.token_budget, the supervised (assistant) share, what is dropped and "
                                          "why, how full the token-budget buffers are, and the first document with "
                                          "its supervised tokens marked. A training run logs the same summary at "
                                          "start."),
                        epilog="examples:\n  dflash data inspect --config configs/tiny.yaml\n"
                               "  dflash data inspect chats.jsonl --format sharegpt --tokenizer /models/Qwen3-8B\n\n"
                               "exit codes: 0 the data has something to train on; 1 every document was dropped "
                               "(the summary says why); 2 bad config or data (one line naming file and line)",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("data", nargs="*", metavar="DATA",
                   help="files or directories (replace the config's data.paths; without --config: the defaults)")
    i.add_argument("--config", help="a run config YAML: its data section and train.seed")
    i.add_argument("--format", choices=["auto", "text", "chat", "sharegpt"], help="data.format")
    i.add_argument("--text-field", help="data.text_field (the key/column holding text)")
    i.add_argument("--messages-field", help="data.messages_field (the key/column holding a chat)")
    i.add_argument("--thinking", choices=["keep", "drop"], help="data.thinking")
    i.add_argument("--tokenizer", help="data.tokenizer: a local Hugging Face tokenizer directory")
    i.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _data(args: argparse.Namespace) -> int:
    from dflash.config import ConfigError, DataConfig, load_config
    from dflash.data import DataError
    from dflash.data_inspect import inspect

    overrides = {k: getattr(args, a) for k, a in (("format", "format"), ("text_field", "text_field"),
                                                  ("messages_field", "messages_field"), ("thinking", "thinking"),
                                                  ("tokenizer", "tokenizer")) if getattr(args, a) is not None}
    if args.data:
        overrides["paths"] = [str(Path(p).resolve()) for p in args.data]
    if "tokenizer" in overrides:
        overrides["tokenizer"] = str(Path(overrides["tokenizer"]).resolve())
    if args.config is None and not args.data:
        return _fail("data inspect needs --config CONFIG or DATA paths")
    notes = []
    try:
        if args.config is not None:
            cfg = load_config(args.config, quick=True)  # the data is all it reads: no torch, no transformers
            data = DataConfig(**{**cfg.data.model_dump(), **overrides})
            seed = cfg.train.seed
            if cfg.target.regen is not None:
                notes.append("target.regen is set: training uses the target's own continuations of this corpus's "
                             "prompts (made on first use), not this text itself")
        else:
            data, seed = DataConfig(**overrides), 0
    except ConfigError as exc:
        return _fail(str(exc))
    except ValueError as exc:  # pydantic: a bad override
        return _fail(f"data inspect: {str(exc).splitlines()[-2].strip() if len(str(exc).splitlines()) > 1 else exc}")
    try:
        return inspect(data, seed, config_path=args.config, as_json=args.json, notes=notes)
    except DataError as exc:
        return _fail(str(exc))


def _eval(args: argparse.Namespace) -> int:
    from dflash.eval import run

    return run(args)


def _fail(msg: str) -> int:
    from dflash import telemetry
    from dflash.telemetry import stderr_line

    lines = msg.splitlines() or [msg]
    for line in lines:  # a config with several problems: one `dflash: ...` line each
        stderr_line(f"dflash: {line}")
    if len(lines) > 1:  # what torchrun's report and opsctl's reason carry: the first problem, and that there are more
        telemetry.last_stderr_line = f"dflash: {lines[0]} (and {len(lines) - 1} more: see the log)"
    return 2


def _train(args: argparse.Namespace) -> int:
    """The CLI's part only: arguments and the config file; every check before OUT is touched is train()'s preflight
    (dflash/runprep.py), run once, with the CLI's own steps as its hooks."""
    from dflash.config import ConfigError, load_config
    from dflash.data import DataError

    if args.max_steps is not None and args.max_steps < 1:
        return _fail(f"--max-steps must be at least 1, got {args.max_steps}")
    try:
        cfg = load_config(args.config)
        if args.init_from is not None:
            cfg.train.init_from = str(Path(args.init_from).resolve())
    except ConfigError as exc:
        return _fail(str(exc))
    from dflash.runprep import RunPrep
    from dflash.train import UsageError, train

    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem

    def check_init_from(prep: RunPrep) -> None:
        if prep.cfg.train.init_from is not None and not prep.resume:  # a resume continues its checkpoint
            _check_init_from(prep)  # before anything (a cached target's log line too) reaches --out

    def target_and_data(prep: RunPrep) -> None:
        # target.pretrain / target.regen: built on first use, cached; their log lines go to OUT/train.log
        prep.cfg, prep.docs = _target_and_data(prep.cfg, prep.docs, out)

    try:
        result = train(cfg, out, max_steps=args.max_steps, resume={"always": True, "auto": "auto"}.get(args.resume, False),
                       fresh=args.fresh, allow_slow_kernels=args.allow_slow_kernels, before_lock=check_init_from,
                       under_lock=target_and_data)
    except (DataError, UsageError, ConfigError) as exc:
        return _fail(str(exc))
    if result.world_size > 1:
        _leave_without_teardown(result.exit_code)
    return result.exit_code


def _check_init_from(prep: Any) -> None:
    """--init-from against the config, before train() writes to OUT: the target's depth and width from its config,
    the taps, and the mask token (the run's tokenizer where reading it writes nothing; else a tiny BPE trained into
    a scratch cache so OUT stays untouched). Raises UsageError with the one line to show; train() checks the same
    again when it builds the drafter."""
    import dataclasses
    import tempfile

    from dflash.data import load_tokenizer
    from dflash.init_from import InitFromError, check_init_from
    from dflash.target import resolve_tap_layers, target_shape
    from dflash.train import UsageError

    cfg = prep.cfg
    shape = target_shape(cfg.target)
    taps = resolve_tap_layers(cfg.target.tap_layers, shape.num_layers, cfg.drafter.num_layers)
    mask = cfg.drafter.mask_token_id
    if mask is None:
        tok = prep.tokenizer_if_free()
        if tok is None and cfg.data.tokenizer_cache:  # a shared cache, not OUT: trained into it, as the run would
            tok = prep.tok = load_tokenizer(cfg.data, prep.docs, cfg.data.tokenizer_cache)
        if tok is None:  # OUT/tokenizer is the run's to write (the Trainer does): a scratch one for the check
            with tempfile.TemporaryDirectory() as tmp:
                tok = load_tokenizer(cfg.data, prep.docs, tmp)
        mask = tok.mask_token_id
    dcfg = dataclasses.replace(cfg.drafter, mask_token_id=mask)
    try:
        check_init_from(cfg.train.init_from, dcfg, shape.hidden_size, taps)
    except InitFromError as exc:
        raise UsageError(str(exc)) from None


def _leave_without_teardown(code: int) -> None:
    """End a multi-rank process now. Everything the run owes is already on disk (events closed, checkpoints
    fsynced, the process group destroyed); what is left is torch's process-group destructors, which can deadlock
    with the GIL at interpreter exit (dflash/train.py, _KEPT_ALIVE), so they are skipped."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _target_and_data(cfg: Any, docs: Any, out: Path | None, regen: bool = True) -> tuple[Any, Any]:
    """Resolve `target.pretrain` (dflash/pretrain.py) to a pretrained target.path and `target.regen`
    (dflash/regen.py) to the target's own records as training documents; progress also goes to OUT/train.log, so
    `opsctl launch` shows the one-off pretraining and regeneration instead of silent minutes."""
    from dflash.pretrain import resolve_target
    from dflash.regen import regenerated_documents

    def log(msg: str) -> None:
        if out is None:
            print(msg, flush=True)
            return
        # The file first, then the same line on stdout, as train.log's own handlers do: opsctl's wrapper drops a
        # stdout line the run already wrote to the log, so it is shown once.
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "train.log", "a") as fh:
            fh.write(line + "\n")
        print(line, flush=True)

    cfg = resolve_target(cfg, docs, log=log)
    return cfg, (regenerated_documents(cfg, docs, log=log) if regen else docs)


def _pretrain_target(args: argparse.Namespace) -> int:
    from dflash.config import ConfigError, load_config
    from dflash.data import DataError, load_tokenizer, read_documents
    from dflash.locks import LockBusy
    from dflash.pretrain import cache_root, pretrain
    from dflash.target import TargetPretrainConfig

    try:
        cfg = load_config(args.config)
        if cfg.target.path is not None:
            raise ConfigError(f"{cfg.source}: target.path: already names a target ({cfg.target.path}); "
                              "pretrain-target trains target.arch")
        docs = read_documents(cfg.data)
        pc = cfg.target.pretrain or TargetPretrainConfig()
        cache = Path(cfg.data.tokenizer_cache) if cfg.data.tokenizer_cache else cache_root(pc) / "tokenizer"
        tok = load_tokenizer(cfg.data, docs, cache)
        summary = pretrain(cfg, docs, tok, args.out)
    except (ConfigError, DataError, LockBusy) as exc:
        return _fail(str(exc))
    print(f"pretrain-target: wrote {args.out} (held-out loss {summary['loss']['val']:.3f} nats/token, unigram "
          f"{summary['unigram_val_nats']:.3f}); use it with `target: {{path: {args.out}}}`")
    return 0


def _regen(args: argparse.Namespace) -> int:
    from dflash.config import ConfigError, check_run, load_config
    from dflash.data import DataError, read_documents
    from dflash.locks import LockBusy
    from dflash.regen import RegenSettings, regen

    try:
        cfg = load_config(args.config)
        check_run(cfg, "cuda" if _cuda() else "cpu")
        rc = cfg.target.regen  # a flag left out takes the config's target.regen value: the same records
        settings = RegenSettings(
            max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None or rc is None else rc.max_new_tokens,
            temperature=args.temperature if args.temperature is not None else (rc.temperature if rc else 0.0),
            prompt_tokens=args.prompt_tokens if args.prompt_tokens is not None or rc is None else rc.prompt_tokens,
            num_prompts=args.num_prompts if args.num_prompts is not None or rc is None else rc.num_prompts,
            batch_size=args.batch_size if args.batch_size is not None else (rc.batch_size if rc else 128),
            seed=args.seed)
        settings.check()
        docs = read_documents(cfg.data)
        cfg, _ = _target_and_data(cfg, docs, None, regen=False)
        summary = regen(cfg, docs, args.out, settings)
    except (ConfigError, DataError, LockBusy) as exc:
        return _fail(str(exc))
    print(f"regen: {summary['written']} new records ({summary['new_tokens']} tokens) in {summary['records']}; "
          f"train on them with `data: {{paths: [{args.out}]}}`")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _preflight(args: argparse.Namespace) -> int:
    import torch

    from dflash.config import ConfigError, check_run, load_config
    from dflash.kernels import check_kernels
    from dflash.model import resolve_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        cfg = load_config(args.config)
        check_run(cfg, device.type)
    except ConfigError as exc:
        return _fail(str(exc))
    from dflash.target import probe_kernels

    kernels = {**probe_kernels(cfg.target, cfg.data.vocab_size),
               "attention": resolve_attention(cfg.drafter.attention, device)}
    print(f"device: {device}")
    for op, impl in kernels.items():
        print(f"  {op:34s} {impl}")
    problems = check_kernels(kernels, device, args.allow_slow_kernels or cfg.target.allow_slow_kernels)
    for p in problems:
        print(f"problem: {p}")
    print("preflight: " + ("FAILED" if problems else "ok"))
    return 1 if problems else 0


def _export(args: argparse.Namespace) -> int:
    from dflash.checkpoint import CheckpointError
    from dflash.export import ExportCheckFailed, ExportError, export_checkpoint

    if args.check is not None:
        if args.checkpoint is not None or args.out is not None:
            return _fail("export --check DIR checks an existing export; it takes no --checkpoint/--out")
        return _export_check(args.check, args.target)
    if args.checkpoint is None or args.out is None:
        return _fail("export needs --checkpoint STEP_DIR and --out DIR (or --check EXPORT_DIR)")
    try:
        path = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, target_dir=args.target)
    except ExportCheckFailed as exc:
        from dflash.telemetry import stderr_line

        for line in exc.problems:
            stderr_line(f"dflash export: {line}")
        stderr_line(f"dflash export: {args.out}: not written ({len(exc.problems)} problem(s) above)")
        return 1
    except (CheckpointError, ExportError, ValueError) as exc:
        return _fail(str(exc))
    print(f"exported {args.checkpoint} -> {path} ({args.dtype}, passes the SGLang/vLLM loader checks)")
    return 0


def _export_check(where: str, target: str | None) -> int:
    """`dflash export --check`: problems one per line on stderr, exit 1; notes (engine flags) on stdout."""
    from dflash.export_check import check_export, render, target_facts_from_dir
    from dflash.telemetry import stderr_line

    if not Path(where).is_dir():
        return _fail(f"{where}: not an export directory")
    try:
        facts = target_facts_from_dir(target) if target is not None else None
    except ValueError as exc:
        return _fail(str(exc))
    res = check_export(where, facts)
    for line in res.problems:
        stderr_line(f"dflash export --check: {line}")
    for note in res.notes:
        print(f"note: {note}")
    print(render(res, where))
    return 1 if res.problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    rc = _unknown_command(parser, sys.argv[1:] if argv is None else argv)
    if rc is None:
        args = parser.parse_args(argv)
        rc = _check_config_first(args)
    if rc is not None:
        _tell_torchrun(rc)
        return rc
    try:
        rc = {"train": _train, "preflight": _preflight, "export": _export, "eval": _eval,
              "pretrain-target": _pretrain_target, "regen": _regen, "data": _data}[args.cmd](args)
        sys.stdout.flush()  # a pipe's buffered tail is written here, where a closed reader is handled, not at exit
    except BrokenPipeError:
        rc = _reader_closed_the_pipe()
    if rc:
        _tell_torchrun(rc)
    return rc


EXIT_PIPE_CLOSED = 141  # what a shell reports for a process ended by SIGPIPE (128 + 13), as `git log | head` gives


def _reader_closed_the_pipe() -> int:
    """`dflash data inspect | head`: the reader has what it wanted and closed the pipe. Not an error worth a traceback,
    and not exit 1 (for eval that says "not lossless"): stdout goes to /dev/null, so the interpreter's final flush
    cannot raise again, and the exit status is the shell's for SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE_CLOSED


def _unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> int | None:
    """`dflash trian`: one line with the nearest command (argparse lists every choice and no suggestion), exit 2."""
    import difflib

    word = next((a for a in argv if not a.startswith("-")), None)  # the top level takes no option with a value
    commands = next((list(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), [])
    if word is None or word in commands:
        return None
    close = difflib.get_close_matches(word, commands, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f" (commands: {', '.join(commands)})"
    return _fail(f"unknown command '{word}'{hint}")


def _check_config_first(args: argparse.Namespace) -> int | None:
    """Check --config completely (unknown keys, types, ranges: every field's problem, one line each; the rules
    between two fields once the fields are valid) before the command imports torch, so a typo costs a fraction of a
    second instead of several seconds and one round per mistake.
    target.arch's key names need transformers (which imports torch): the command's own full load checks those."""
    path = getattr(args, "config", None)
    if path is None:
        return None
    from dflash.config import ConfigError, load_config

    try:
        load_config(path, quick=True)
    except ConfigError as exc:
        return _fail(str(exc))
    return None


class _Version(argparse.Action):
    """`dflash --version`: this package's version and the torch and transformers it would run with, read from the
    installed packages' metadata (importing torch to ask it would take seconds)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the dflash-ops, torch and transformers versions and exit", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit(0)


def version_line() -> str:
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"dflash {version('dflash-ops')} (torch {version('torch')}, transformers {version('transformers')}, "
            f"python {sys.version.split()[0]})")


def _tell_torchrun(rc: int) -> None:
    """Under torchrun, leave the error line this rank ended with (`dflash: ...`) in its error file: a rank that
    exits with a code has no traceback for torchrun to report, so without it torchrun's root cause says only
    `exitcode 2` and the reason is lost in the log among the other ranks' output."""
    from dflash import telemetry

    path, line = os.environ.get("TORCHELASTIC_ERROR_FILE"), telemetry.last_stderr_line
    if not path or not line:
        return
    try:
        with open(path, "w") as fh:
            json.dump({"message": line, "timestamp": int(time.time())}, fh)
    except OSError:
        pass  # the exit code still says it failed


if __name__ == "__main__":
    sys.exit(main())
