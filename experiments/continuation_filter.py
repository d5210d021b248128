"""Does stage 3 drop the same continuation states when each is compared only with the anchors of its own
prompt (:func:`~aloe_build.stages.s3_rollouts.not_anchors_of_prompt`, linear in the edits) as when it is
compared with every anchor (quadratic)? Runs the default build's stages 1-3 on a slice and counts, for
the continuations of the requests and of their chat forms, the states each filter drops and the states
on which they disagree.

    python -m experiments.continuation_filter --edits $DATA/counterfact/counterfact-val.json --start 1500 --n 100
"""

from __future__ import annotations

import argparse
import json

import aloe_build.pipeline as pipeline
import aloe_build.stages.s3_rollouts as s3
from aloe_build import BuildConfig, build_operator, load_edits, load_model


class _StageThreeDone(Exception):
    """Raised after stage 3: the rest of the build is not needed."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--edits", required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--n", type=int, default=100)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    requests = load_edits(args.edits)[args.start : args.start + args.n]
    rows: list[dict] = []
    grouped, rollouts = s3.not_anchors_of_prompt, s3.rollouts

    def both(states, state_prompt, anchors, anchor_prompt):
        keep = grouped(states, state_prompt, anchors, anchor_prompt)
        full = s3.not_anchors(states, anchors)
        rows.append(
            {
                "states": int(states.shape[0]),
                "dropped_by_prompt": int((~keep).sum()),
                "dropped_by_all_anchors": int((~full).sum()),
                "disagree": int((keep != full).sum()),
            }
        )
        return keep

    def stop_after(*a, **k):
        rollouts(*a, **k)
        raise _StageThreeDone

    s3.not_anchors_of_prompt = both
    pipeline.rollouts = stop_after  # the pipeline holds its own reference to the stage
    try:
        build_operator(model, tokenizer, requests, BuildConfig())
    except _StageThreeDone:
        pass
    for name, row in zip(["request continuations", "chat-form answers"], rows):
        print(json.dumps({"pass": name, **row}))


if __name__ == "__main__":
    main()
