"""Requests asked as a served chat model is asked: through the model's own chat template.

Each edit's request becomes the user turn of a conversation (after the template's default system
prompt, or after :data:`CUSTOM_SYSTEM`); the model answers greedily for :data:`CHAT_TOKENS`
tokens. Metrics, per system prompt:

- ``efficacy``: the target appears in the answer (case-insensitive);
- ``efficacy_prefix``: the answer starts with the target (case-insensitive, leading space ignored);
- ``locality``: each locality prompt asked the same way gets token for token the unedited
  model's answer (up to its end of turn);
- ``unedited_efficacy``: how often the unedited model already gives the target (the floor);
- ``in_context_efficacy`` (and ``unedited_in_context_efficacy``): the target in the answer when the user
  turn is the request after one unrelated sentence (the first of the plain protocol's two in-context
  forms, :func:`aloe_eval.in_context.request_in_context`).

The told control (:class:`aloe_eval.editors.ToldEditor`) is the unedited model asked each of these
user turns with its edit's statement as the first sentence ("<request> <target>. <question>"); its
locality answers are compared with the unedited model's answers to the plain questions, and it has
no distracted locality (``None``: its questions already follow the statement).

For an editor with slots (ALOE), ``locality_changes`` says which gates changed the locality answers
that changed (:func:`changed_locality_gates`), and ``gates`` holds the own slot's gate at the last prompt token (the
template's assistant header, where the answer starts): its mean, the share of requests where it is
open (at least ``open_threshold``), and the misses split as in the plain protocol: ``address`` (the
gate is not open) or ``write`` (it is, and the answer still lacks the target).
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Sequence

import torch

from aloe_build.forward import Tick, greedy_generate, progress_bar
from aloe_build.states import collect_states
from aloe_build.tokens import chat_prompt, common_prefix_length, pad_id, stop_ids, until_end

from .chunks import ChunkStore
from .content_key import content_key
from .editors import Editor, ToldEditor
from .in_context import request_in_context
from .metrics import contains_target, starts_with_target
from .plan import distracted_prompt, statement

CHAT_TOKENS = 32
#: Bump when what a saved answer list holds changes, so that older files are generated again.
ANSWERS_FORMAT = 1
#: Batches per saved block of a long answer list (what an interrupted evaluation can lose).
ANSWER_BLOCK_BATCHES = 8
CUSTOM_SYSTEM = "You are a helpful assistant. Answer the question directly."
SYSTEMS = {"default_system": None, "custom_system": CUSTOM_SYSTEM}
#: Directory under ALOE's cache root where ``aloe eval --chat`` keeps the unedited model's answers.
CHAT_ANSWERS_CACHE = "chat-answers"
# missed answers kept in a report, to read; the counts are in the metrics
MISSES_SHOWN = 5


def chat_answers(
    model,
    tokenizer,
    questions: Sequence[str | Sequence[str]],
    system: str | None = None,
    *,
    tokens: int = CHAT_TOKENS,
    batch_size: int = 32,
    progress: bool = False,
    desc: str = "chat answers",
    tick: Tick | None = None,
) -> list[list[int]]:
    """Greedy answers (token ids, cut after the end of turn) of ``questions`` asked as the user
    turn of the model's chat template (a sequence of texts: consecutive user turns), after
    ``system`` (None: the template's default). ``tick(k)`` is called after each batch of ``k``."""
    prompts = [chat_prompt(tokenizer, q, system) for q in questions]
    stops = stop_ids(tokenizer)
    gens = greedy_generate(
        model, prompts, tokens, pad_id=pad_id(tokenizer), batch_size=batch_size, progress=progress, desc=desc, tick=tick
    )
    return [until_end(g, stops) for g in gens]


def saved_chat_answers(
    model,
    tokenizer,
    questions: Sequence[str | Sequence[str]],
    system: str | None,
    *,
    store: ChunkStore,
    file: str,
    key: str,
    tokens: int = CHAT_TOKENS,
    batch_size: int = 32,
    progress: bool = False,
    desc: str = "chat answers",
) -> list[list[int]]:
    """:func:`chat_answers`, read from ``store`` (``file`` under ``key``) when saved there, else
    generated and saved; a long list is saved every :data:`ANSWER_BLOCK_BATCHES` batches as well, so
    that an interrupted run loses at most one block.

    The blocks take the questions in the order :func:`greedy_generate` batches them (shortest prompt
    first) and hold whole batches, so every batch, and so every answer, is the one a single call
    gives: answers saved before blocks existed stay valid under the same key."""
    saved = store.read(file, key)
    if saved is not None:
        return saved["answers"]
    lengths = [len(chat_prompt(tokenizer, q, system)) for q in questions]
    order = sorted(range(len(questions)), key=lambda i: (lengths[i], i))
    step = batch_size * ANSWER_BLOCK_BATCHES
    got: list[list[int]] = [[] for _ in questions]
    names = []
    bar = progress_bar(len(questions), desc, progress)
    try:
        for lo in range(0, len(order), step):
            block = order[lo : lo + step]
            name, block_key = f"{file}-block{lo // step:05d}", content_key([key, lo, step])
            names.append(name)
            part = store.read(name, block_key)
            if part is None:
                asked = [questions[i] for i in block]
                answers = chat_answers(
                    model, tokenizer, asked, system, tokens=tokens, batch_size=batch_size, desc=desc, tick=bar.update
                )
                part = {"answers": answers}
                store.write(name, block_key, part)
            else:
                bar.update(len(block))
            for i, answer in zip(block, part["answers"]):
                got[i] = answer
    finally:
        bar.close()
    store.write(file, key, {"answers": got})
    for name in names:
        store.remove(name)
    return got


def own_gates(
    model,
    tokenizer,
    requests: Sequence[Any],
    editor: Editor,
    system: str | None,
    hit: Sequence[bool],
    open_threshold: float = 0.5,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Statistics of each request's own-slot gate at the last token of its chat prompt (module doc)."""
    seqs = [chat_prompt(tokenizer, r.prompt, system) for r in requests]
    h = collect_states(model, tokenizer, seqs, editor.layer, [[len(q) - 1] for q in seqs], batch_size).states
    gates = editor.slot_activations(h)
    own, missed = [], []
    for i, r in enumerate(requests):
        slot = editor.chat_slot_of(r, i)
        if slot is not None:
            own.append(float(gates[i, slot]))
            missed.append(not hit[i])
    g = torch.tensor(own)
    m = torch.tensor(missed, dtype=torch.bool)
    return {
        "open_threshold": open_threshold,
        "mapped": len(own),
        "own_gate_mean": float(g.mean()) if own else None,
        "open_share": float((g >= open_threshold).float().mean()) if own else None,
        "misses": {"address": int((m & (g < open_threshold)).sum()), "write": int((m & (g >= open_threshold)).sum())},
    }


def changed_locality_gates(
    model,
    tokenizer,
    editor: Editor,
    prompts: Sequence[list[int]],
    unedited: Sequence[list[int]],
    edited: Sequence[list[int]],
    owner_slots: Sequence[Collection[int]],
    open_threshold: float = 0.5,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Where the changed chat-locality answers changed: for each, the largest gate of any slot on the
    states that predict its answer up to the first changed token (the chat prompt, then the unedited
    answer so far), counted by size (``open``: at least ``open_threshold``; ``small``; ``closed``: no
    gate at all, so not the operator's doing), by slot (one of ``owner_slots``, the slots of the
    locality prompt's own edit, or another) and by where it sits (in the prompt or in the answer)."""
    seqs, prompt_lens = [], []
    for p, a, b in zip(prompts, unedited, edited):
        seqs.append(list(p) + list(a[: common_prefix_length(a, b)]))
        prompt_lens.append(len(p))
    counts = {
        "changed": len(seqs),
        "open": 0,
        "small": 0,
        "closed": 0,
        "own_slot": 0,
        "other_slot": 0,
        "in_prompt": 0,
        "in_answer": 0,
    }
    if not seqs:
        return counts
    batch = collect_states(model, tokenizer, seqs, editor.layer, None, batch_size)
    for i, (n_prompt, own) in enumerate(zip(prompt_lens, owner_slots)):
        g = editor.slot_activations(batch.of(i))  # (positions, slots)
        best, pos = g.max(1).values.max(0)
        if float(best) <= 0:
            counts["closed"] += 1
            continue
        counts["open" if float(best) >= open_threshold else "small"] += 1
        counts["own_slot" if int(g[pos].argmax()) in own else "other_slot"] += 1
        counts["in_prompt" if int(pos) < n_prompt else "in_answer"] += 1
    return counts


def chat_evaluation(
    model,
    tokenizer,
    requests: Sequence[Any],
    editor: Editor,
    *,
    batch_size: int = 32,
    progress: bool = True,
    systems: dict[str, str | None] | None = None,
    tokens: int = CHAT_TOKENS,
    open_threshold: float = 0.5,
    parts: ChunkStore | None = None,
    context: Any = None,
    model_context: Any = None,
    unedited_parts: ChunkStore | None = None,
) -> dict[str, Any]:
    """Score ``editor`` on ``requests`` in chat form, once per system prompt (see the module doc).

    With ``parts`` each list of answers is saved there as it is generated (in blocks,
    :func:`saved_chat_answers`), keyed by
    ``model_context`` (what identifies the model), ``context`` (what identifies the editor: an
    operator's fingerprint), the system prompt, the questions and ``tokens``; an interrupted
    evaluation reads them back instead of generating them again. The unedited model's answers do not
    depend on the editor: they are keyed without ``context`` and kept in ``unedited_parts`` when
    given (a cache shared by every evaluation of the model), else in ``parts``."""
    systems = SYSTEMS if systems is None else systems
    out: dict[str, Any] = {"tokens": tokens, "edits": len(requests)}
    told = isinstance(editor, ToldEditor)

    def tell(owners: Iterable[int], questions: Sequence[str]) -> list[str]:
        """The questions the editor is asked: for the told control each after its edit's statement, in
        the same user turn; for any other editor the questions themselves."""
        return [distracted_prompt(requests[o], q) if told else q for o, q in zip(owners, questions)]

    for name, system in systems.items():
        asks = [r.prompt for r in requests]
        in_ctx = [request_in_context(r.prompt, i)[0] for i, r in enumerate(requests)]
        loc_owner = [i for i, r in enumerate(requests) for _ in r.locality]
        locs = [lp.prompt for r in requests for lp in r.locality]
        # the same locality questions, each after its edit's statement in a user turn of its own
        distracted = [(statement(requests[o]), q) for o, q in zip(loc_owner, locs)]

        def answers(desc: str, questions=asks, edited: bool = True) -> list[list[int]]:
            key = content_key([ANSWERS_FORMAT, model_context, context if edited else None, desc, system, tokens, list(questions)])
            # an edited list has one file per editor of the evaluation (a changed editor replaces it);
            # an unedited one, one per key (the store may be shared)
            file = f"chat-{content_key([name, desc, editor.name])}" if edited else f"chat-unedited-{key}"
            store = parts if edited or unedited_parts is None else unedited_parts
            run = dict(tokens=tokens, batch_size=batch_size, progress=progress, desc=f"chat ({name}): {desc}")
            if store is None:
                return chat_answers(model, tokenizer, questions, system, **run)
            return saved_chat_answers(model, tokenizer, questions, system, store=store, file=file, key=key, **run)

        base_ask = answers("unedited requests", edited=False)
        base_loc = answers("unedited locality", locs, edited=False)
        # the told control has no distracted answers: its locality questions already follow the statement
        base_dis = None if told else answers("unedited distracted locality", distracted, edited=False)
        base_ctx = answers("unedited in-context requests", in_ctx, edited=False)
        editor.attach(model)
        try:
            ask = answers("edited requests", tell(range(len(requests)), asks))
            loc = answers("edited locality", tell(loc_owner, locs))
            dis = None if told else answers("edited distracted locality", distracted)
            ctx = answers("edited in-context requests", tell(range(len(requests)), in_ctx))
        finally:
            editor.detach(model)
        out[name], hit = _chat_scores(tokenizer, requests, system, ask, base_ask, loc, base_loc, loc_owner)
        out[name]["in_context_efficacy"] = _target_share(tokenizer, requests, ctx)
        out[name]["unedited_in_context_efficacy"] = _target_share(tokenizer, requests, base_ctx)
        if dis is not None and base_dis is not None:
            out[name].update(_distracted_scores(tokenizer, requests, dis, base_dis, loc_owner))
        else:
            out[name].update({"distracted_locality": None, "distracted_leak": None})
        if editor.has_slots and editor.layer is not None:
            out[name].update(
                _chat_gate_diagnostics(
                    model, tokenizer, requests, editor, system, hit, locs, loc, base_loc, loc_owner, open_threshold, batch_size
                )
            )
    return out


def _chat_scores(
    tokenizer,
    requests: Sequence[Any],
    system: str | None,
    ask: Sequence[list[int]],
    base_ask: Sequence[list[int]],
    loc: Sequence[list[int]],
    base_loc: Sequence[list[int]],
    loc_owner: Sequence[int],
) -> tuple[dict[str, Any], list[bool]]:
    """The metrics of one system prompt (module doc) from the edited and unedited answers, and which
    requests the edited model answered with their target (the gate diagnostics split the misses)."""
    text = [tokenizer.decode(g, skip_special_tokens=True) for g in ask]
    targets = [r.target_new for r in requests]
    # locality is averaged per edit first, so that an edit with many locality prompts weighs no more than one with few
    stable_by_edit: dict[int, list[bool]] = {}
    for owner, a, b in zip(loc_owner, loc, base_loc):
        stable_by_edit.setdefault(owner, []).append(a == b)
    hit = [contains_target(t, y) for t, y in zip(text, targets)]
    misses = [{"request": r.prompt, "target": r.target_new, "answer": t} for r, t, h in zip(requests, text, hit) if not h]
    scores = {
        "system": system,
        "efficacy": sum(hit) / len(hit),
        "efficacy_prefix": sum(starts_with_target(t, y) for t, y in zip(text, targets)) / len(text),
        "unedited_efficacy": _target_share(tokenizer, requests, base_ask),
        "locality": (sum(sum(v) / len(v) for v in stable_by_edit.values()) / len(stable_by_edit) if stable_by_edit else None),
        # one owner per locality prompt, so this counts the prompts
        "locality_prompts": len(loc_owner),
        # a few examples to read, not the whole list
        "misses": misses[:MISSES_SHOWN],
    }
    return scores, hit


def _target_share(tokenizer, requests: Sequence[Any], answers: Sequence[list[int]]) -> float:
    """The share of answers (one per request) that contain their request's target."""
    texts = [tokenizer.decode(g, skip_special_tokens=True) for g in answers]
    return sum(contains_target(t, r.target_new) for t, r in zip(texts, requests)) / len(requests)


def _distracted_scores(
    tokenizer, requests: Sequence[Any], dis: Sequence[list[int]], base_dis: Sequence[list[int]], loc_owner: Sequence[int]
) -> dict[str, Any]:
    """Chat locality after the edit's statement, and the leak to its target: an answer that changed
    and now names the target where the unedited answer did not (each averaged per edit, then over edits)."""
    stable: dict[int, list[bool]] = {}
    leak: dict[int, list[bool]] = {}
    for owner, a, b in zip(loc_owner, dis, base_dis):
        target = requests[owner].target_new
        text, base = (tokenizer.decode(g, skip_special_tokens=True) for g in (a, b))
        stable.setdefault(owner, []).append(a == b)
        leak.setdefault(owner, []).append(a != b and contains_target(text, target) and not contains_target(base, target))

    def per_edit(d: dict[int, list[bool]]) -> float | None:
        return sum(sum(v) / len(v) for v in d.values()) / len(d) if d else None

    return {"distracted_locality": per_edit(stable), "distracted_leak": per_edit(leak)}


def _chat_gate_diagnostics(
    model,
    tokenizer,
    requests: Sequence[Any],
    editor: Editor,
    system: str | None,
    hit: Sequence[bool],
    locs: Sequence[str],
    loc: Sequence[list[int]],
    base_loc: Sequence[list[int]],
    loc_owner: Sequence[int],
    open_threshold: float,
    batch_size: int,
) -> dict[str, Any]:
    """``gates`` and ``locality_changes`` of one system prompt for an editor with slots (module doc)."""
    # only the locality answers that changed need explaining; the unchanged ones are left out
    changed = [k for k, (a, b) in enumerate(zip(loc, base_loc)) if a != b]
    loc_prompts = [chat_prompt(tokenizer, locs[k], system) for k in changed]
    with editor.reading(model):  # the states below are what the gates read
        gates = own_gates(model, tokenizer, requests, editor, system, hit, open_threshold, batch_size)
        changes = changed_locality_gates(
            model,
            tokenizer,
            editor,
            loc_prompts,
            [base_loc[k] for k in changed],
            [loc[k] for k in changed],
            [editor.edit_slots(requests[loc_owner[k]], loc_owner[k]) for k in changed],
            open_threshold,
            batch_size,
        )
    return {"gates": gates, "locality_changes": changes}


def chat_markdown(result: dict[str, Any]) -> str:
    """One row per system prompt."""
    lines = [
        "| system prompt | efficacy (target in answer) | exact prefix | unedited | chat locality "
        "| own gate open | mean own gate | misses: address / write | distracted loc. | leak to target | in context |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result.items():
        if isinstance(r, dict) and "efficacy" in r:
            loc = "n/a" if r["locality"] is None else f"{r['locality']:.4f}"
            g = r.get("gates")
            gates = (
                f"{g['open_share']:.4f} | {g['own_gate_mean']:.4f} | {g['misses']['address']} / {g['misses']['write']}"
                if g and g["mapped"]
                else "n/a | n/a | n/a"
            )
            cols = ("distracted_locality", "distracted_leak", "in_context_efficacy")
            dis = " | ".join("n/a" if r.get(k) is None else f"{r[k]:.4f}" for k in cols)
            lines.append(
                f"| {name} | {r['efficacy']:.4f} | {r['efficacy_prefix']:.4f} | {r['unedited_efficacy']:.4f} | {loc} | {gates} "
                f"| {dis} |"
            )
    changes = [(name, r["locality_changes"]) for name, r in result.items() if isinstance(r, dict) and "locality_changes" in r]
    if changes:
        lines += [
            "",
            "Changed chat-locality answers, by the largest gate before the first changed token:",
            "",
            "| system prompt | changed | gate open / small / none | own edit's slot / another | in prompt / in answer |",
            "|---|---|---|---|---|",
        ]
        for name, c in changes:
            lines.append(
                f"| {name} | {c['changed']} | {c['open']} / {c['small']} / {c['closed']} | "
                f"{c['own_slot']} / {c['other_slot']} | {c['in_prompt']} / {c['in_answer']} |"
            )
    return "\n".join(lines)
