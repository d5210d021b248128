"""One rank of a tiny distributed build (run by tests/build/test_distributed.py through the launcher).

Usage: ``distributed_tiny_build.py CONFIG_JSON OUT_DIR [--chat] [--first N] [--chunk N] [--block N] [--fail STAGE]``:
builds the tiny pipeline's edits (its first N) with the BuildConfig fields in CONFIG_JSON
(``--chat``: the tokenizer has the tiny chat template; ``--chunk``: passes in chunks of N sequences;
``--block``: stage 5 scores blocks of N slots, stage 7 gates blocks of N states);
rank 0 saves the operator in OUT_DIR/op.
With ``--fail`` the last rank raises when that stage starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
from test_pipeline import _edits  # noqa: E402
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer  # noqa: E402

from aloe_build import BuildConfig, build_operator, chunked, distributed, open_gates  # noqa: E402
from aloe_build.pipeline import _Build  # noqa: E402
from aloe_build.stages import s5_calibrate  # noqa: E402


def main() -> None:
    cfg = BuildConfig.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    out = Path(sys.argv[2])
    distributed.init_from_launcher(torch.device("cpu"))
    tok = tiny_tokenizer()
    if "--chunk" in sys.argv:
        chunked.CHUNK_SEQUENCES = int(sys.argv[sys.argv.index("--chunk") + 1])
    if "--block" in sys.argv:
        s5_calibrate.CALIBRATION_BLOCK = open_gates.BLOCK_ROWS_MIN = int(sys.argv[sys.argv.index("--block") + 1])
        open_gates.BLOCK_BYTES = 0  # blocks of BLOCK_ROWS_MIN states
    if "--chat" in sys.argv:
        tok.chat_template = TINY_CHAT_TEMPLATE
    if "--fail" in sys.argv and distributed.rank() == distributed.world_size() - 1:
        failing, stage = sys.argv[sys.argv.index("--fail") + 1], _Build.stage

        def fail_at(self, name, fn):
            if name == failing:
                fn = lambda: (_ for _ in ()).throw(RuntimeError("injected failure"))  # noqa: E731
            return stage(self, name, fn)

        _Build.stage = fail_at
    edits = _edits()[: int(sys.argv[sys.argv.index("--first") + 1])] if "--first" in sys.argv else _edits()
    finished = False
    try:
        op = build_operator(tiny_model("llama"), tok, edits, cfg, out_dir=out / "run", log=print)
        if distributed.is_main():
            op.save(out / "op")
        finished = True
    finally:
        distributed.shutdown(finished)
    distributed.end_process(0)


if __name__ == "__main__":
    main()
