"""CLI commands for the levers file: ``levers get``, ``levers set``, ``levers validate``."""
from __future__ import annotations

import argparse
import json
import os
import sys

from telemetry import cli_args, levers as lv
from telemetry.echo import cut_echo
from telemetry.lever_spec import ENV_PREFIX

EXIT_INVALID = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    levers = subparsers.add_parser("levers", help="read, change or validate the levers file")
    actions = levers.add_subparsers(dest="action", required=True, metavar="ACTION")

    get = actions.add_parser("get", help="effective values: defaults < CHUNKSCOPE_* env < file; says which it read")
    cli_args.add_levers_file_args(get, required=False)
    get.add_argument("--json", action="store_true", help="print one JSON object (with where it read from)")
    get.set_defaults(handler=cmd_get)

    set_ = actions.add_parser("set", help="change one lever in the file (bumps its version)")
    set_.add_argument("name", choices=list(lv.LEVERS_BY_NAME), metavar="NAME",
                      help="the lever (python -m telemetry levers list shows them all)")
    set_.add_argument("value", metavar="VALUE", help="its new value: an integer in ASCII digits, true / false, or "
                                                    "one of a choice lever's names")
    cli_args.add_levers_file_args(set_, required=True)
    set_.set_defaults(handler=cmd_set)

    validate = actions.add_parser("validate", help="exit 0 for a valid file, 2 with one line otherwise")
    validate.add_argument("path", metavar="FILE", nargs="?", default=None,
                          help="levers JSON file (or --file FILE / --run-dir DIR, like get and set)")
    cli_args.add_levers_file_args(validate, required=False)
    validate.set_defaults(handler=cmd_validate)

    list_ = actions.add_parser("list", help="every lever with type, default, range and help (no options)")
    list_.set_defaults(handler=cmd_list)


def _invalid(message: str) -> int:
    print(f"invalid: {cut_echo(message)}", file=sys.stderr)     # a 10 kB value is not echoed whole
    return EXIT_INVALID


def cmd_get(args: argparse.Namespace) -> int:
    try:
        values = lv.from_env()
    except lv.LeversError as exc:
        return _invalid(str(exc))
    version, path = None, cli_args.levers_path(args)
    env_names = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and
                       k[len(ENV_PREFIX):].lower() in lv.LEVERS_BY_NAME)
    source = "defaults" + (f" < environment ({', '.join(env_names)})" if env_names else "")
    if path is not None and _is_absent(path):
        source += f" (no file at {path} yet: an engine there runs on these)"
    elif path is not None:
        result = lv.read_levers_file(path, values)
        if result.error:
            return _invalid(result.error)
        values, version = result.values, result.version
        source += f" < {path} (version {version})"
    if args.json:
        print(json.dumps({"version": version, "read_from": source, "levers": values.as_dict()}, indent=2))
    else:
        print(f"read from: {source}")
        if path is None:
            print("  (no levers file given: --run-dir DIR or --file FILE reads the one an engine follows)")
        for name, value in values.as_dict().items():
            print(f"{name:<20} {json.dumps(value)}")
    return 0


def _is_absent(path: str) -> bool:
    """No file there (any other trouble, a name too long or no permission, is read and reported)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def cmd_set(args: argparse.Namespace) -> int:
    args.file = cli_args.levers_path(args)
    lever = lv.LEVERS_BY_NAME[args.name]
    try:
        value = lever.parse_text(args.value)
    except lv.LeversError as exc:
        return _invalid(str(exc))
    version, file_values = 0, {}
    if os.path.exists(args.file):
        try:
            with open(args.file, "rb") as handle:
                version, file_values = lv.validate_file_bytes(handle.read(lv.MAX_FILE_BYTES + 1))
        except (OSError, lv.LeversError) as exc:
            return _invalid(f"{args.file}: {exc} (fix or remove it before set)")
    file_values[args.name] = value
    try:
        lv.write_levers_file(args.file, version + 1, file_values)
    except OSError as exc:
        return _invalid(f"{args.file}: cannot write: {exc.strerror or exc}")
    print(f"{args.name} = {json.dumps(value)} (version {version + 1})")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    named = cli_args.levers_path(args)
    if (args.path is None) == (named is None):
        return _invalid("give the levers file once: --file FILE, --run-dir DIR (or FILE)")
    args.path = args.path or named
    try:
        with open(args.path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            raw = handle.read(lv.MAX_FILE_BYTES + 1)
        if size > lv.MAX_FILE_BYTES:
            raise lv.LeversError(f"file is {size} bytes, over the {lv.MAX_FILE_BYTES}-byte limit")
        version, values = lv.validate_file_bytes(raw)
    except OSError as exc:
        return _invalid(f"{args.path}: cannot read: {exc.strerror or exc}")
    except lv.LeversError as exc:
        return _invalid(f"{args.path}: {exc}")
    print(f"ok: {args.path} version {version}, {len(values)} lever(s)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    for lever in lv.LEVERS:
        print(f"{lever.name} ({lever.type.__name__}, default {json.dumps(lever.default)}, "
              f"{lever.describe_range()}, env {lever.env_var})\n    {lever.help}")
    return 0
