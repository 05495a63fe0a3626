"""The start handshake: one fixed-size int64 vector per rank, all-gathered before the first forward.

Every collective after it sizes its buffers from settings the ranks are assumed to share (the dtype
of the SSM states rank 0 broadcasts, the hidden size of an exchanged row). Ranks that disagree on
one would meet a collective whose two sides expect different byte counts, and gloo answers that with
``EnforceNotMet ... 512 vs 256`` and an abort. The handshake itself never has that problem: every
rank sends ``len(FIELDS)`` int64 values whatever its settings, so a disagreement is found here, named
field by field, and the run fails with a message instead.
"""
from __future__ import annotations

import torch

# (field name, what the message calls it). The order is the wire format: never reorder, only append.
FIELDS = (("dtype", "dtype"), ("hidden_size", "hidden size"), ("ep", "--ep"), ("kv_blocks", "--kv-blocks"),
          ("ssm_slots", "--ssm-slots"), ("block_size", "block size"), ("exchange", "--ep-exchange"),
          ("checkpoint", "checkpoint hash"))
# dtype names <-> codes on the wire; 0 (in both tables) is a name the table does not know.
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, "float64": 4}
# --ep-exchange names <-> codes, a table of its own (not exchange.EXCHANGES' order, which may change;
# exchange.py imports group.py, which imports this module).
EXCHANGE_CODES = {"all_to_all": 1, "all_gather": 2}
CHECKPOINT_HEX = 15  # hash digits carried: 60 bits fit a signed int64


def encode(checkpoint_hash: str, settings: dict) -> torch.Tensor:
    """This rank's handshake, int64 [len(FIELDS)]; ``settings`` is ``worker.start_settings``'s dict."""
    dtype = str(settings["dtype"]).removeprefix("torch.")
    values = {**settings, "dtype": DTYPE_CODES.get(dtype, 0),
              "exchange": EXCHANGE_CODES.get(settings["exchange"], 0),
              "checkpoint": int(checkpoint_hash[:CHECKPOINT_HEX] or "0", 16)}
    return torch.tensor([int(values[name]) for name, _ in FIELDS], dtype=torch.long)


def _shown(name: str, value: int) -> str:
    if name in ("dtype", "exchange"):
        codes = DTYPE_CODES if name == "dtype" else EXCHANGE_CODES
        return next((shown for shown, code in codes.items() if code == value), f"unknown ({value})")
    if name == "checkpoint":
        return f"{value:0{CHECKPOINT_HEX}x}..."
    return str(value)


def disagreements(every: list[list[int]]) -> list[str]:
    """Pure: for each field where some rank differs from rank 0, 'dtype: rank 0 float32, rank 1 bfloat16'."""
    found = []
    for index, (name, label) in enumerate(FIELDS):
        values = [row[index] for row in every]
        if any(value != values[0] for value in values):
            found.append(f"{label}: " + ", ".join(f"rank {rank} {_shown(name, value)}"
                                                  for rank, value in enumerate(values)))
    return found
