"""`octavo eval`: perplexity of an artifact on a text file or a built-in evaluation text."""

from __future__ import annotations

import argparse
import json

from tqdm.auto import tqdm

from octavo.commands.common import add_engine_arguments, console, create_engine, follow_engine, number_at_least
from octavo.eval.corpus import text_digest
from octavo.eval.perplexity import DEFAULT_STRIDE, DEFAULT_WINDOW, perplexity, plan_windows, tokenize_text
from octavo.eval.sources import BUILTIN_NAMES, read_text


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="perplexity of an artifact on a text (same tokens for every artifact "
                                                "of a model)")
    parser.add_argument("artifact", help="artifact directory")
    parser.add_argument("--perplexity", required=True, metavar="FILE|NAME",
                        help="text or JSONL file (a \"text\" field per line), or a built-in text the default "
                             f"calibration never saw: {', '.join(BUILTIN_NAMES)} (default: the standard library's "
                             "docstrings; code: its source; reference: the language reference; prose: English "
                             "prose)")
    parser.add_argument("--window", type=int, default=None,
                        help=f"tokens per scored window (default {DEFAULT_WINDOW}, or max_model_len - 1 if less)")
    parser.add_argument("--stride", type=int, default=None,
                        help=f"tokens between window starts (default {DEFAULT_STRIDE}, or the window if less)")
    parser.add_argument("--max-text-tokens", type=number_at_least(1), default=None, metavar="N",
                        help="score only the first N tokens of the text (quick checks)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    follower_exit = follow_engine(args)
    if follower_exit is not None:
        return follower_exit
    text = read_text(args.perplexity)
    engine = create_engine(args)
    try:
        # A window is a prompt the engine generates one token after: the default leaves it that room.
        window = args.window if args.window is not None else min(DEFAULT_WINDOW, engine.max_model_len - 1)
        stride = args.stride if args.stride is not None else min(DEFAULT_STRIDE, window)
        token_ids = tokenize_text(engine.tokenizer, text, args.max_text_tokens)
        windows = plan_windows(len(token_ids), window, stride)
        with tqdm(total=sum(w.scored for w in windows), desc="scoring", unit="tok") as progress:
            result = perplexity(engine, token_ids, window, stride, on_window=progress.update)
    finally:
        engine.shutdown()  # a parallel engine's other ranks (other nodes' too) end with it
    record = {**result.as_dict(), "text": args.perplexity, "text_sha256": text_digest(text),
              "artifact": args.artifact}
    if args.json:
        console.out(json.dumps(record))
    else:
        windows = f"{result.windows} window{'s' if result.windows != 1 else ''}"
        console.print(f"perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens scored "
                      f"({windows} of {result.window}, stride {result.stride}; "
                      f"tokens sha256 {result.tokens_sha256[:16]})")
    return 0
