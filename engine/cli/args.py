"""The engine commands' named argument types (seeds, counts, scales), built on the bounded types both
CLIs share (``telemetry/cli_args.py``): a bad number is an argparse error, one line, exit 2."""
from __future__ import annotations

import math

from telemetry.cli_args import MAX_SQLITE_INT, bounded_float, bounded_int

seed = bounded_int(0, MAX_SQLITE_INT)
non_negative_int = bounded_int(0)
positive_int = bounded_int(1)
positive_float = bounded_float(0.0, low_open=True)
finite_float = bounded_float(-math.inf)     # range checks left to the callee, which names its field
