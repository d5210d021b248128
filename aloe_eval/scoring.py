"""Scoring one editor on a planned stream: forward passes, per-edit rows, summary.

The unedited model's locality generations and teacher-forced results are
computed once (:func:`build_reference`) and shared by every editor.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from aloe_build.forward import TFResult, greedy_generate, teacher_forced
from aloe_build.tokens import until_end

from .definitions import PORTABILITY_MAX_TOKENS
from .editors import Editor, UneditedEditor
from .metrics import contains_target, exact_match, mean, relative_drift, token_accuracy
from .plan import EditPlan, Registry, told_plan
from .report import EditorResult
from .summary import gate_plot_data, heatmap, pca, summarize


class Reference:
    """The unedited model's locality generations and teacher-forced results, computed once."""

    def __init__(self) -> None:
        self.cache: dict[int, TFResult] = {}  # registry index -> unedited TFResult


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def build_reference(
    model,
    reg: Registry,
    plans: list[EditPlan],
    *,
    pad_id: int,
    stops: set[int],
    batch_size: int,
    progress: bool,
    timings: dict[str, float],
) -> Reference:
    """The unedited model's greedy continuation of every locality prompt, cut after its first stop
    token (``stops``; a server stops there, so what the model would write after it is never
    seen and is not compared), and its teacher-forced pass."""
    ref = Reference()
    t0 = time.perf_counter()
    # 1. the unedited model's greedy continuations of every unique locality prompt
    uniq: dict[tuple[tuple[int, ...], int], int] = {}
    items = [lp for p in plans for lp in p.locality + p.distracted]
    for lp in items:
        uniq.setdefault((lp.prompt_ids, lp.k), len(uniq))
    keys = list(uniq)
    gens = greedy_generate(
        model,
        [k[0] for k in keys],
        [k[1] for k in keys],
        pad_id=pad_id,
        batch_size=batch_size,
        progress=progress,
        desc="unedited: locality generations",
    )
    for lp in items:
        g = until_end(gens[uniq[(lp.prompt_ids, lp.k)]], stops)
        lp.gen_seq = reg.add(lp.prompt_ids, tuple(g), hidden=True)
    # 2. the unedited teacher-forced pass over everything locality needs
    need = sorted({lp.gen_seq for lp in items} | {lp.tf_seq for lp in items if lp.tf_seq is not None})
    res = teacher_forced(
        model,
        [reg.seqs[j] for j in need],
        pad_id=pad_id,
        batch_size=batch_size,
        hidden=[reg.want_hidden[j] for j in need],
        progress=progress,
        desc="unedited: locality reference",
    )
    ref.cache.update(zip(need, res))
    timings["reference_s"] = timings.get("reference_s", 0.0) + time.perf_counter() - t0
    return ref


def told_inputs(tokenizer, reg: Registry, plans: list[EditPlan], ref: Reference) -> tuple[Registry, list[EditPlan], Reference]:
    """The registry, plans and reference the told control is scored on (:func:`aloe_eval.plan.told_plan`),
    from the plain ones after :func:`build_reference`. Each told locality sequence's reference is the
    unedited result of the plain sequence it stands for: its locality compares the answer after the
    statement with the answer to the plain prompt (against itself it would be 1 by construction)."""
    told_reg, told_plans, plain_of = told_plan(tokenizer, reg, plans)
    told_ref = Reference()
    told_ref.cache = {j: ref.cache[i] for j, i in plain_of.items()}
    return told_reg, told_plans, told_ref


def score_editor(
    model,
    tokenizer,
    editor: Editor,
    reg: Registry,
    plans: list[EditPlan],
    ref: Reference,
    *,
    pad_id: int,
    batch_size: int,
    progress: bool,
    open_threshold: float,
    heatmap_size: int = 32,
    pca_points: int = 1024,
) -> EditorResult:
    """Patch ``editor`` in, run every pass it needs, remove it, and score the stream."""
    t0 = time.perf_counter()
    scorer = _Scorer(tokenizer, editor, reg, plans, ref, open_threshold, pca_points)
    editor.attach(model)
    try:
        scorer.run(model, pad_id=pad_id, batch_size=batch_size, progress=progress)
    finally:
        editor.detach(model)
    rows = [scorer.row(p) for p in plans]
    summary = summarize(rows, slots=scorer.slots, open_threshold=open_threshold)
    plots: dict[str, Any] = {}
    if scorer.slots:
        plots["heatmap"] = heatmap(editor, plans, scorer.tf, heatmap_size)
        plots["gates"] = gate_plot_data(rows)
    if scorer.pca_pairs and not scorer.unedited:
        plots["pca"] = pca(scorer.pca_pairs)
    scorer.timings["total_s"] = time.perf_counter() - t0
    info = {**editor.info(), "timings": scorer.timings}
    return EditorResult(editor.name, summary, rows, info, plots)


class _Scorer:
    """The passes of one editor and the per-edit rows built from them, with the statistics
    that the summary collects along the way."""

    def __init__(
        self,
        tokenizer,
        editor: Editor,
        reg: Registry,
        plans: list[EditPlan],
        ref: Reference,
        open_threshold: float,
        pca_points: int,
    ):
        self.tokenizer, self.editor, self.reg, self.plans, self.ref = tokenizer, editor, reg, plans, ref
        self.open_threshold, self.pca_points = open_threshold, pca_points
        self.unedited = isinstance(editor, UneditedEditor)
        self.slots = editor.has_slots
        self.timings: dict[str, float] = {}
        self.tf: dict[int, TFResult] = {}
        self.generated: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self.pca_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen_loc: set[int] = set()

    # -- passes -------------------------------------------------------------------------------

    def run(self, model, *, pad_id: int, batch_size: int, progress: bool) -> None:
        """The teacher-forced pass over every sequence, then greedy generation where it says "not the target"."""
        reg, ref, name = self.reg, self.ref, self.editor.name
        todo = list(range(len(reg.seqs)))
        if self.unedited:
            todo = [j for j in todo if j not in ref.cache]
        t = time.perf_counter()
        # The sequences of the unedited reference pass go through in the same batches as there: in
        # bfloat16 a sequence's logits depend on what it is batched with, and a locality prompt would
        # otherwise count as changed by an edit that changed nothing.
        shared = [j for j in todo if j in ref.cache]  # the reference pass's list, in its order
        self.tf = {}
        for part in (shared, [j for j in todo if j not in ref.cache]):
            res = teacher_forced(
                model,
                [reg.seqs[j] for j in part],
                pad_id=pad_id,
                batch_size=batch_size,
                editor=self.editor,
                hidden=[reg.want_hidden[j] for j in part],
                progress=progress,
                desc=f"{name}: teacher-forced",
            )
            self.tf.update(zip(part, res))
        if self.unedited:
            self.tf.update(ref.cache)
        self.timings["teacher_forced_s"] = time.perf_counter() - t
        jobs = self._generation_jobs()
        t = time.perf_counter()
        gens = greedy_generate(
            model,
            [j[0] for j in jobs],
            [j[1] for j in jobs],
            pad_id=pad_id,
            batch_size=batch_size,
            progress=progress,
            desc=f"{name}: generate misses",
        )
        self.generated = dict(zip(jobs, gens))
        self.timings["generate_s"] = time.perf_counter() - t
        self.timings["n_generated"] = len(jobs)

    def _generation_jobs(self) -> list[tuple[tuple[int, ...], int]]:
        """(prompt, length) of every request, rephrase, in-context request and portability prompt not
        produced teacher-forced."""
        reg = self.reg
        jobs: dict[tuple[tuple[int, ...], int], None] = {}
        for p in self.plans:
            for j in [p.seq] + [r.seq for r in p.rephrases] + [r.seq for r in p.in_context]:
                if not self.all_right(j):
                    jobs[(reg.seqs[j][0], len(reg.seqs[j][1]))] = None
            for pp in p.portability:
                if not self.all_right(pp.seq):
                    jobs[(reg.seqs[pp.seq][0], _portability_tokens(pp))] = None
            for lp in p.distracted:  # a changed answer is generated, to see whether it took the edit's target
                if self.tf[lp.gen_seq].preds != self.ref.cache[lp.gen_seq].preds:
                    jobs[(lp.prompt_ids, lp.k)] = None
        return list(jobs)

    def all_right(self, j: int) -> bool:
        return self.tf[j].preds == self.reg.seqs[j][1]

    def gen_text(self, j: int) -> tuple[bool, str]:
        """Paper exact match of sequence j (a request, rephrase or in-context request) and the text the
        model generates."""
        p, c = self.reg.seqs[j]
        if self.all_right(j):
            return True, _decode(self.tokenizer, c)
        return False, _decode(self.tokenizer, self.generated[(p, len(c))])

    # -- rows ---------------------------------------------------------------------------------

    def slot_diag(self, j: int, slot: int | None, hit: bool) -> dict[str, Any]:
        """Gate diagnostics of sequence j for the edit's own slot; a miss is an address or write failure."""
        if not self.slots:
            return {}
        r = self.tf[j]
        g = r.gate(slot)
        top_slot, top_gate = r.top()
        dom = slot is not None and g > 0 and top_gate <= g
        failure = None
        if not hit:
            failure = "unmapped" if slot is None else ("write" if g >= self.open_threshold else "address")
        return {
            "gate": g,
            "top_slot": top_slot,
            "top_gate": top_gate,
            "dominates": dom,
            "failure": failure,
            "open_slots": int(r.gate_idx.numel()) if r.gate_idx is not None else 0,
        }

    def row(self, p: EditPlan) -> dict[str, Any]:
        """The per-edit row: the request, its rephrases, the request in context, locality and
        portability prompts."""
        r = p.request
        slot = self.editor.slot_of(r, p.index) if self.slots else None
        hit_tf, text = self.gen_text(p.seq)
        eff = hit_tf or exact_match(text, r.target_new)
        row: dict[str, Any] = {
            "id": r.id if r.id is not None else f"edit-{p.index}",
            "prompt": r.prompt,
            "target": r.target_new,
            "slot": slot,
            "efficacy": float(eff),
            "generation": text,
            "rewrite_acc": token_accuracy(self.tf[p.seq].preds, self.reg.seqs[p.seq][1]),
            "target_nll": self.tf[p.seq].nll,
        }
        if self.slots:
            d = self.slot_diag(p.seq, slot, eff)
            row.update({f"request_{k}": v for k, v in d.items()})
        reph_rows = [self.rephrase_row(rp, r.target_new, slot) for rp in p.rephrases]
        row["generalization"] = mean(x["em"] for x in reph_rows)
        row["rephrase_acc"] = mean(x["tf_acc"] for x in reph_rows)
        row["rephrases"] = reph_rows
        ctx_rows = [self.rephrase_row(cp, r.target_new, slot) for cp in p.in_context]
        row["in_context"] = mean(x["em"] for x in ctx_rows)
        row["in_context_prompts"] = ctx_rows
        loc_rows = [self.locality_row(lp) for lp in p.locality]
        row["locality"] = mean(x["stable"] for x in loc_rows)
        row["locality_tf"] = mean(x.get("tf_stability") for x in loc_rows)
        row["locality_prompts"] = loc_rows
        port_rows = [self.portability_row(pp) for pp in p.portability]
        row["portability"] = mean(x["em"] for x in port_rows)
        row["portability_tf"] = mean(x["tf_acc"] for x in port_rows)
        row["portability_prompts"] = port_rows
        dis_rows = [self.distracted_row(lp, r.target_new) for lp in p.distracted]
        row["distracted_locality"] = mean(x["stable"] for x in dis_rows)
        row["distracted_leak"] = mean(x["leak"] for x in dis_rows)
        row["distracted_prompts"] = dis_rows
        return row

    def rephrase_row(self, rp, target: str, slot: int | None) -> dict[str, Any]:
        hit_tf, text = self.gen_text(rp.seq)
        em = hit_tf or exact_match(text, target)
        rr = {
            "prompt": rp.prompt,
            "em": float(em),
            "generation": text,
            "tf_acc": token_accuracy(self.tf[rp.seq].preds, self.reg.seqs[rp.seq][1]),
        }
        if self.slots:
            d = self.slot_diag(rp.seq, slot, em)
            rr.update(d)
        return rr

    def locality_row(self, lp) -> dict[str, Any]:
        j = lp.gen_seq
        ref_r, ed_r = self.ref.cache[j], self.tf[j]
        stable = ed_r.preds == ref_r.preds
        lr: dict[str, Any] = {
            "prompt": lp.prompt,
            "kind": lp.kind,
            "ground_truth": lp.ground_truth,
            "k": len(self.reg.seqs[j][1]),
            "stable": float(stable),
            "reference": _decode(self.tokenizer, ref_r.preds),
            "generation": _decode(self.tokenizer, ed_r.preds),
            "next_token_agree": float(ed_r.preds[0] == ref_r.preds[0]),
        }
        if ref_r.hidden is not None and ed_r.hidden is not None:
            lr["drift"] = relative_drift(ed_r.hidden, ref_r.hidden)
        if lp.tf_seq is not None:
            lr["tf_stability"] = token_accuracy(self.tf[lp.tf_seq].preds, self.ref.cache[lp.tf_seq].preds)
        if self.slots:
            lr["max_gate"] = ed_r.prompt_max_gate
            lr["max_slot"] = ed_r.prompt_max_slot
        if j not in self.seen_loc and "drift" in lr and len(self.pca_pairs) < self.pca_points:
            self.seen_loc.add(j)  # the PCA plot shows unique locality prompts
            self.pca_pairs.append((ref_r.hidden, ed_r.hidden))
        return lr

    def distracted_row(self, lp, target: str) -> dict[str, Any]:
        """A locality prompt after the edit's statement: unchanged as :meth:`locality_row` counts it,
        and whether a changed answer took the edit's target where the unedited model's did not."""
        j = lp.gen_seq
        ref_r, ed_r = self.ref.cache[j], self.tf[j]
        stable = ed_r.preds == ref_r.preds
        reference = _decode(self.tokenizer, self.reg.seqs[j][1])
        generation = reference if stable else _decode(self.tokenizer, self.generated[(lp.prompt_ids, lp.k)])
        leak = not stable and contains_target(generation, target) and not contains_target(reference, target)
        dr: dict[str, Any] = {
            "prompt": lp.prompt,
            "kind": lp.kind,
            "stable": float(stable),
            "leak": float(leak),
            "reference": reference,
            "generation": generation,
        }
        if self.slots:
            dr["max_gate"] = ed_r.prompt_max_gate
            dr["max_slot"] = ed_r.prompt_max_slot
        return dr

    def portability_row(self, pp) -> dict[str, Any]:
        seq = self.reg.seqs[pp.seq]
        if self.all_right(pp.seq):
            em, text = True, _decode(self.tokenizer, seq[1])
        else:
            g = self.generated[(seq[0], _portability_tokens(pp))]
            text = _decode(self.tokenizer, g)
            em = any(exact_match(_decode(self.tokenizer, g[: len(a_ids)]), a) for a, a_ids in zip(pp.answers, pp.answer_ids))
        pr = {
            "prompt": pp.prompt,
            "kind": pp.kind,
            "answers": list(pp.answers),
            "em": float(em),
            "generation": text,
            "tf_acc": token_accuracy(self.tf[pp.seq].preds, seq[1]),
        }
        if self.slots:
            pr["max_gate"] = self.tf[pp.seq].prompt_max_gate
        return pr


def _portability_tokens(pp) -> int:
    """Tokens generated for a portability prompt: its longest answer's, at most PORTABILITY_MAX_TOKENS."""
    return min(PORTABILITY_MAX_TOKENS, max(len(a) for a in pp.answer_ids))
