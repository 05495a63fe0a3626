"""``--compile {auto,on,off}`` / ``--no-compile``: the compiled decode step on serve and generate."""
from __future__ import annotations

import argparse

from engine.model.compiled_decode import COMPILE_CHOICES


def add_compile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="decode-only ticks through torch.compile, batch padded to 1,2,4..64 rows "
                             "(auto: CUDA graphs on a GPU, eager on CPU where inductor's compile costs "
                             "minutes; on: inductor on CPU, compiled at start, cached under the cache dir)")
    parser.add_argument("--no-compile", dest="compile", action="store_const", const="off",
                        help="every forward eager (same as --compile off)")
