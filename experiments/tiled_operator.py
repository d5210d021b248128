"""An operator of any size tiled from a built one, with the reading of one's choice: the same
addresses, thresholds, temperatures and writes repeated (ids made distinct) up to ``--slots`` rows.

For timing only: what decode costs with n slots, and what the running reading adds over the
last-token reading on the very same tensors (``--reading-decay 0`` and the built value), where no
operator of that size built with each reading is at hand. Its answers mean nothing (repeated
slots open together).

    python -m experiments.tiled_operator OPERATOR_DIR --slots 1301 --reading-decay 0.85 --out DIR
    python -m benchmarks.hf_decode_cpu --operator DIR --batch 1,8 --threads 1 --out FILE
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from aloe_kernels import AloeOperator


def tiled(op: AloeOperator, slots: int, reading_decay: float) -> AloeOperator:
    """``op``'s rows repeated in order up to ``slots`` rows, each copy's ids suffixed ``#k``, read
    with ``reading_decay``."""
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    copies = []
    for k in range(-(-slots // op.n)):
        edits = [{**e, "id": f"{e['id']}#{k}", "ids": [f"{e['id']}#{k}"]} for e in op.edits]
        copies.append(dataclasses.replace(op, edits=edits))
    return dataclasses.replace(AloeOperator.merge(copies).select(range(slots)), reading_decay=float(reading_decay))


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("operator", help="a built operator directory")
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--reading-decay", type=float, required=True, help="0: the last-token reading")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    op = tiled(AloeOperator.load(args.operator), args.slots, args.reading_decay)
    path = op.save(args.out)
    print(f"wrote {op.n} slots (reading decay {op.reading_decay}) to {path}")
    return path


if __name__ == "__main__":
    main()
