"""``generate``'s grammar: ``--json-schema FILE`` / ``--regex R`` / ``--choice a,b`` as a request's grammar
dict, and its matcher compiled at once (one generation has no tick loop to keep free)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.grammar.compiler import GrammarCompiler
from engine.grammar.spec import GrammarSpec


def grammar_state(model, tokenizer, grammar: dict):
    """A compiled matcher for one generation (compiled here: there is no tick loop to keep free)."""
    if tokenizer is None:
        raise ValueError("a grammar needs the model's tokenizer.json")
    compiler = GrammarCompiler.for_model(model, tokenizer, model.config.vocab_size)
    try:
        return compiler.new_state(compiler.compile_now(GrammarSpec.parse(grammar)))
    finally:
        compiler.close()


def grammar_from_args(args: argparse.Namespace) -> dict | None:
    """--json-schema FILE | --regex R | --choice a,b as a request's grammar dict (None without one)."""
    given = [name for name in ("json_schema", "regex", "choice") if getattr(args, name, None) is not None]
    if len(given) > 1:
        raise ValueError("give at most one of --json-schema, --regex and --choice")
    if args.json_schema is not None:
        path = Path(args.json_schema)
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"--json-schema {path}: not valid JSON ({exc})") from None
        return {"kind": "json_schema", "value": schema}
    if args.regex is not None:
        return {"kind": "regex", "value": args.regex}
    if args.choice is not None:
        return {"kind": "choice", "value": [c for c in args.choice.split(",") if c]}
    return None
