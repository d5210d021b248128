"""Names, limits and one-line definitions of every number an evaluation report holds."""

from __future__ import annotations

#: Version 2 keeps the per-edit rows in a gzip JSONL file beside the report.
SCHEMA = "aloe-eval/2"
LOCALITY_MAX_TOKENS = 16
LOCALITY_DEFAULT_TOKENS = 8
PORTABILITY_MAX_TOKENS = 16

METRIC_DEFINITIONS: dict[str, str] = {
    "paper.efficacy": "greedy generation of len(target tokens) tokens after the request; hit when the decoded "
    "generation, stripped, equals target_new (target tokens = continuation tokens of prompt + ' ' + target); "
    "a row whose teacher-forced argmax is right at every target position is a hit (identical greedy output); "
    "mean over edits",
    "paper.generalization": "the same exact match on each rephrase; mean over an edit's rephrases, then over edits "
    "with rephrases",
    "paper.in_context": "the same exact match on the request after one unrelated sentence "
    "(aloe_eval.in_context.PREFIXES, none in the construction corpus), two forms per edit with the sentences taken "
    "in turn over the stream; mean per edit, then over edits",
    "paper.locality": "share of locality prompts whose greedy generation of k tokens (k = tokens of the first "
    "ground truth, clipped to [1, 16]; 8 without one) is token-for-token unchanged from the unedited model's, up to "
    "and including the unedited model's first EOS or end-of-turn token, where a server stops; mean per edit, then "
    "over edits",
    "paper.locality_outside_stream": "paper.locality over the locality prompts that are not the request of an edit "
    "of the scored stream (a large stream edits some of its own neighbourhood prompts, whose answers are then meant "
    "to change); mean per edit over such prompts, then over edits that have one",
    "paper.distracted_locality": "paper.locality of each locality prompt asked after the edit's statement "
    "('<request> <target>. <locality prompt>'): the edited model's answer against the unedited model's on the same "
    "prompt, so that copying from the context cancels out; mean per edit, then over edits",
    "paper.distracted_leak": "share of those prompts whose answer changed and now contains the edit's target, where "
    "the unedited model's answer did not; mean per edit, then over edits",
    "told": "the row 'unedited, told the fact' (--baseline told): the unedited model, no weight changed, asked every "
    "prompt of an edit after the edit's statement ('<request> <target>. <prompt>'); its paper.locality compares the "
    "answer to '<statement> <locality prompt>' with the unedited answer to the plain locality prompt (what telling "
    "the fact changes in an unrelated answer), and it has no distracted locality (–): that would compare the "
    "unedited model with itself on the same prompts",
    "paper.portability": "exact match of the greedy generation to any accepted answer; mean per edit, then over edits",
    "easyedit.rewrite_acc": "EasyEdit teacher-forced token accuracy on prompt + ' ' + target_new",
    "easyedit.rephrase_acc": "EasyEdit teacher-forced token accuracy on rephrase + ' ' + target_new",
    "easyedit.locality": "EasyEdit: share of positions of prompt + ' ' + ground_truth[0] where the edited model's "
    "teacher-forced argmax equals the unedited model's",
    "easyedit.portability": "EasyEdit teacher-forced token accuracy on prompt + ' ' + ground_truth[0]",
    "diagnostics.matched_gate": "gate of the edit's own slot at the last prompt token",
    "diagnostics.dominates": "own slot's gate > 0 and largest of all slots at the last prompt token",
    "diagnostics.locality_max_gate": "largest gate over all slots and all prompt tokens of a locality prompt",
    "diagnostics.open": "gate >= open_threshold",
    "diagnostics.address_failure": "a miss whose matched gate is not open",
    "diagnostics.write_failure": "a miss whose matched gate is open",
    "diagnostics.hits_own_gate_shut": (
        "hits whose matched gate is not open: the answer came from another slot "
        "(of an edit with the same target) or from the model"
    ),
    "locality_states.drift": "|s_edit - s_unedited| / |s_unedited| of the final hidden state (LM-head input) at the "
    "last prompt token of a locality prompt",
    "locality_states.next_token_agreement": "share of locality prompts whose argmax next token is unchanged",
}


# =============================================================================
# Editors
# =============================================================================
