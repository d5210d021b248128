"""The CounterFact development stream for builds at scale (about 7,900 edits).

CounterFact val first (so that the stream's first 839 edits are, but for the records dropped
below, the 839-edit development stream of the other results), then the records of CounterFact
train that the bundled construction corpus does not use. Every record that shares a case id, a
(subject, prompt) pair or the whole record with the corpus is dropped, as is any later record
repeating an earlier prompt (``aloe_eval.streams.disjoint_stream``); the report beside the
stream counts each.

    python -m benchmarks.counterfact_stream --data $DATA/counterfact --out runs/cf-stream.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aloe_build.corpus import default_corpus_path
from aloe_build.data import load_edits, save_edits_jsonl
from aloe_eval.streams import disjoint_stream


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="directory with counterfact-val.json and counterfact-train.json")
    ap.add_argument("--out", required=True, help="JSONL file to write; the report goes to <out>.report.json")
    ap.add_argument("--corpus", default=None, help="construction corpus (default: the bundled one)")
    args = ap.parse_args(argv)
    data = Path(args.data)
    corpus = load_edits(args.corpus or default_corpus_path())
    sources = [("counterfact-val", load_edits(data / "counterfact-val.json")),
               ("counterfact-train", load_edits(data / "counterfact-train.json"))]
    stream, report = disjoint_stream(sources, corpus)
    if any(report.checks.values()):  # pragma: no cover - disjoint_stream removes every overlap
        raise SystemExit(f"stream still overlaps the corpus: {report.checks}")
    path = save_edits_jsonl(stream, args.out)
    Path(f"{path}.report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    print(f"wrote {report.kept} edits to {path}; dropped {report.dropped}; checks {report.checks}")
    return path


if __name__ == "__main__":
    main()
