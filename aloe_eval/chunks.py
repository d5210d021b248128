"""Evaluation of a long stream in chunks of edits, each saved as it finishes, so that an
interrupted evaluation resumes at the first chunk not yet scored.

Every editor is built once for the whole stream (one operator, the paper's protocol); only the
scoring is split. A chunk's rows are those a single pass would give (each edit's prompts are
scored on their own), and the summary is made from the rows of all chunks
(:func:`aloe_eval.summary.summarize`), so the numbers do not depend on the chunk size. The gate
heatmap and the PCA plot show the first chunk.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Sequence

from aloe_build.checkpoints import write_atomically

from .content_key import content_key
from .report import EditorResult, jsonable
from .summary import gate_plot_data, summarize

#: Bump when what a chunk file holds changes, so that older files are rescored, not misread.
#: 2: locality references end at the first stop token; 3: distracted locality rows; 4: in-context requests
CHUNK_FORMAT = 4


def chunk_bounds(n: int, size: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each chunk of ``size`` edits (one chunk when ``size`` is None)."""
    if size is not None and size <= 0:
        raise ValueError(f"chunk size must be positive, got {size}")
    step = n if size is None else size
    return [(lo, min(lo + step, n)) for lo in range(0, n, max(step, 1))]


def chunk_key(requests: Sequence[Any], lo: int, context: dict[str, Any]) -> str:
    """What a chunk's scores depend on: its edits (position, id, every prompt and target) and the
    evaluation's ``context`` (editors, operator hash, layer, settings)."""

    def edit(r: Any) -> list:
        return [
            getattr(r, "id", None),
            r.prompt,
            r.target_new,
            list(r.rephrases),
            [[lp.prompt, lp.kind, lp.ground_truth] for lp in r.locality],
            [[pp.prompt, pp.kind, pp.ground_truth] for pp in r.portability],
        ]

    return content_key([CHUNK_FORMAT, lo, context, [edit(r) for r in requests]])


class ChunkStore:
    """Chunk results under ``root/chunk-<k>.json.gz`` (and other parts of a running evaluation under
    ``root/<name>.json.gz``), each tagged with its key; a file whose key differs (other edits,
    operator or settings) or that cannot be read is scored again."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _file(self, name: str) -> Path:
        return self.root / f"{name}.json.gz"

    def read(self, name: str, key: str) -> dict[str, Any] | None:
        """The payload saved as ``name`` under ``key``; None when there is none, it cannot be read,
        or it was saved under another key."""
        file = self._file(name)
        if not file.is_file():
            return None
        try:
            with gzip.open(file, "rt", encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, EOFError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) and data.get("key") == key else None

    def write(self, name: str, key: str, payload: dict[str, Any]) -> None:
        """Save ``payload`` (JSON-able) as ``name`` under ``key``, atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps(jsonable({**payload, "key": key}), ensure_ascii=False)
        write_atomically(self._file(name), lambda tmp: tmp.write_bytes(gzip.compress(text.encode("utf-8"))))

    def remove(self, name: str) -> None:
        """Delete the file saved as ``name``, if any."""
        self._file(name).unlink(missing_ok=True)

    def get(self, k: int, key: str) -> dict[str, EditorResult] | None:
        data = self.read(f"chunk-{k:05d}", key)
        if data is None:
            return None
        return {
            name: EditorResult(v["name"], v["summary"], v["rows"], v["info"], v["plots"]) for name, v in data["editors"].items()
        }

    def put(self, k: int, key: str, results: dict[str, EditorResult]) -> None:
        self.write(f"chunk-{k:05d}", key, {"editors": {n: r.to_dict() for n, r in results.items()}})

    def clear(self) -> None:
        """Remove the saved files (once the whole report is written)."""
        for f in self.root.glob("*.json.gz"):
            f.unlink()
        if self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()


def merge_results(parts: Sequence[EditorResult], *, slots: bool, open_threshold: float) -> EditorResult:
    """One editor's result over consecutive chunks: rows in stream order, the summary and gate
    plots made from all of them, timings summed, the first chunk's heatmap and PCA."""
    if len(parts) == 1:
        return parts[0]
    rows = [row for p in parts for row in p.rows]
    info = dict(parts[0].info)
    timings: dict[str, float] = {}
    for p in parts:
        for k, v in p.info.get("timings", {}).items():
            timings[k] = timings.get(k, 0) + v
    info["timings"] = timings
    plots = dict(parts[0].plots)
    if "gates" in plots:
        plots["gates"] = gate_plot_data(rows)
    return EditorResult(parts[0].name, summarize(rows, slots=slots, open_threshold=open_threshold), rows, info, plots)
