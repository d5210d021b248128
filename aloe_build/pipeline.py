"""``build_operator``: edit requests in, an ALOE operator out (paper, Method section).

Each stage writes a checkpoint into ``<out>/checkpoints`` (see
:mod:`aloe_build.checkpoints`), so an interrupted build resumes at the first
stage that has none; a NaN stops the build with the stage named and the
earlier checkpoints kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from aloe_kernels import AloeOperator, apply_aloe, remove_aloe, weight_fingerprint
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.operator import DEFAULT_EPS, DEFAULT_GATE_EPS
from aloe_kernels.reading import reading_tracked
from aloe_kernels.reference import gates_from_scores

from . import distributed
from .build_state import BuildState
from .chat_slots import chat_entries, chat_slot_owner, open_at_of
from .checkpoints import StageCheckpoints, run_key
from .config import BuildConfig
from .corpus import Corpus, load_corpus
from .data import EditRequest
from .edited_forward import EditedForward, edited_forward
from .forward import model_device
from .mechanism_protocol import build_encoder
from .models import cache_root, default_layer, model_name
from .open_gates import open_gates
from .rewordings import kept_rewordings
from .slot_sets import negative_set
from .slots import SamePrompt, Slot, make_slots
from .stages import s4_refine, s5_calibrate
from .stages.s1_encoder import AddressEncoder, cache_key
from .stages.s2_init import initial_addresses
from .stages.s3_rollouts import TokenSequences, rollouts, token_sequences
from .stages.s6_targets import write_targets
from .stages.s7_ridge import NegativeGateTally, gates_of, ridge_writes
from .stages.s8_finetune import finetune_writes, produced_rows
from .statement_keeps import statement_keeps
from .states import max_context
from .tokens import encode_continuation


class BuildError(RuntimeError):
    """A build stopped; the message names the stage and what to do."""


@dataclass
class AppendBase:
    """The operator a build appends to, with its build state (:mod:`aloe_build.build_state`)."""

    op: AloeOperator
    state: BuildState


class StageClock:
    """Wall and process CPU time since it was made: a build's stages are compared across runs made
    under different load, where the CPU seconds (all threads) move far less than the wall time."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def reading(self) -> dict[str, float]:
        """Seconds, CPU seconds and the process's peak resident memory so far (GiB)."""
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return {
            "seconds": round(time.perf_counter() - self.wall, 2),
            "cpu_seconds": round(time.process_time() - self.cpu, 2),
            "peak_rss_gib": round(peak_kib / 2**20, 3),
        }


@dataclass
class BuildReport:
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)

    def stage(self, name: str, clock: StageClock, **info: Any) -> None:
        reading = clock.reading()
        if distributed.active():  # called by every rank: the CPU time of all, and the peak of each
            cpu = distributed.summed(torch.tensor(reading["cpu_seconds"], dtype=torch.float64))
            reading.update(
                cpu_seconds_all_ranks=round(float(cpu), 2), peak_rss_gib_per_rank=distributed.gathered(reading["peak_rss_gib"])
            )
        self.stages[name] = {**reading, **info}


def _validate(model, tokenizer, requests: Sequence[EditRequest], layer: int) -> None:
    if not requests:
        raise BuildError("no edit requests: give at least one")
    locate_down_proj(model, layer)  # raises PatchError for a bad layer or a model without an MLP down-projection
    limit = max_context(model, tokenizer)
    ids_seen: set[str] = set()
    for i, r in enumerate(requests):
        if not isinstance(r, EditRequest):
            raise BuildError(f"request {i}: expected an EditRequest, got {type(r).__name__}")
        if not r.target_new.strip():
            raise BuildError(f"request {i} ({r.id}): empty target_new")
        n_tok = sum(map(len, encode_continuation(tokenizer, r.prompt, r.target_new)))
        if n_tok > limit:
            raise BuildError(f"request {i} ({r.id}): prompt + target is {n_tok} tokens, over the model context of {limit}")
        if r.id is not None:
            if r.id in ids_seen:
                raise BuildError(f"request {i}: duplicate id {r.id!r}")
            ids_seen.add(r.id)


def _encoder(model, tokenizer, layer: int, path: Path, corpus: Corpus, cfg: BuildConfig) -> tuple[AddressEncoder, dict, bool]:
    if (path / "encoder.safetensors").is_file():
        enc, metrics = AddressEncoder.load(path)
        return enc, metrics, True
    enc, metrics = build_encoder(model, tokenizer, corpus, layer, cfg)
    enc.save(path, metrics)
    return enc, metrics, False


def _encoder_summary(metrics: dict) -> str:
    """One line per protocol: learned vs raw-control AUC and same-subject top-1."""
    parts = []
    for protocol in ("subject", "relation"):
        m = metrics.get(protocol, {})
        if "learned" in m:
            lr, raw = m["learned"], m["raw_control"]
            top1, raw_top1 = lr.get("same_subject_top1", float("nan")), raw.get("same_subject_top1", float("nan"))
            parts.append(
                f"{protocol}: AUC {lr['scope_auc']:.3f} (raw {raw['scope_auc']:.3f}), "
                f"same-subject top-1 {top1:.3f} (raw {raw_top1:.3f})"
            )
    return "; ".join(parts) or "no held-out diagnostics"


def encoder_cache_dir(cfg: BuildConfig, fingerprint: str, layer: int, corpus_path: Path) -> Path:
    """Where the encoder of a (model weight, layer, corpus, stage-1 settings) lives."""
    root = Path(cfg.encoder_cache) if cfg.encoder_cache else cache_root() / "encoders"
    return root / cache_key(fingerprint, layer, corpus_path, cfg)


def negatives_cache_dir(cfg: BuildConfig, fingerprint: str, layer: int, corpus_path: Path) -> Path:
    """Where the shared negatives of a (model weight, layer, corpus items) live: beside the encoders,
    keyed without the encoder's training settings, so retraining an encoder reuses them."""
    root = Path(cfg.encoder_cache) if cfg.encoder_cache else cache_root() / "encoders"
    return root / "negatives" / cache_key(fingerprint, layer, corpus_path, cfg, corpus_only=True)


def build_operator(
    model,
    tokenizer,
    requests: Sequence[EditRequest],
    config: BuildConfig | None = None,
    out_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = print,
) -> AloeOperator:
    """Build an ALOE operator for ``requests`` on ``model`` (paper, Method section, stages 1-8).

    With ``out_dir`` every stage checkpoints into ``out_dir/checkpoints`` and
    ``out_dir/build_report.json`` records per-stage time, losses, separability
    and gate statistics; the artifact itself is saved by the caller
    (``AloeOperator.save``) or by ``aloe build``.
    """
    return _Build(model, tokenizer, requests, config or BuildConfig(), out_dir, log).run()


class _Build:
    """One build: its settings, checkpoints and report, and a method per stage."""

    def __init__(
        self,
        model,
        tokenizer,
        requests: Sequence[EditRequest],
        cfg: BuildConfig,
        out_dir: str | os.PathLike | None,
        log: Callable[[str], None] | None,
        base: AppendBase | None = None,
    ):
        cfg = cfg.for_tokenizer(tokenizer)
        self.model, self.tokenizer, self.requests, self.cfg, self.base = model, tokenizer, requests, cfg, base
        self.say = log if log is not None and distributed.is_main() else (lambda _msg: None)
        self.layer = cfg.layer if cfg.layer is not None else default_layer(model)
        _validate(model, tokenizer, requests, self.layer)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.site = locate_down_proj(model, self.layer)
        self.fingerprint = weight_fingerprint(self.site.weight())
        self.states_key = self.fingerprint + (f"/reading{cfg.reading_decay}" if cfg.reading_decay else "")  # cached states
        self.device = model_device(model)
        self.out = Path(out_dir) if out_dir else None
        self.ckpt = StageCheckpoints(
            self.out / "checkpoints" if self.out else None,
            run_key(requests, self.fingerprint, self.layer, base.op.fingerprint() if base else ""),
            cfg,
        )
        self.report = BuildReport()
        self.slots: list[Slot] = make_slots(requests)
        self.n = len(self.slots)
        chat = f" and {self.n} chat slots" if cfg.chat.chat_slots else ""
        self.say(f"building {self.n} slots{chat} for {len(requests)} edits at {self.site.path}")
        self.rng = random.Random(cfg.seed)

    def stage(self, name: str, fn: Callable[[], tuple[dict[str, torch.Tensor], dict]]) -> dict[str, torch.Tensor]:
        """Run ``fn`` (tensors and report of the stage) unless a valid checkpoint holds its result."""
        cached = self.ckpt.load(name)
        if distributed.all_agree(cached is not None):
            tensors, meta = cached
            self.report.stages[name] = {**meta.get("report", {}), "resumed": True}
            self.say(f"{name}: resumed from checkpoint")
            return tensors
        clock = StageClock()
        try:
            tensors, info = fn()
        except FloatingPointError as exc:
            where = f"; checkpoints of earlier stages are kept in {self.ckpt.root}" if self.ckpt.root else ""
            raise BuildError(f"{exc}{where}") from exc
        except Exception as exc:
            if distributed.active():  # the launcher stops the other ranks and shows this one's error
                raise BuildError(f"rank {distributed.rank()} failed in stage {name}: {exc!r}") from exc
            raise
        distributed.barrier()  # every rank is done with the stage's parts before rank 0 drops them
        read_back = self.ckpt.read_back(name)
        if read_back:  # its seconds cover the rest of the stage only
            info = {**info, "parts_read_back": read_back}
        self.report.stage(name, clock, **info)
        self.ckpt.save(name, tensors, report=self.report.stages[name])
        self.ckpt.drop_parts(name)
        self.say(f"{name}: done in {self.report.stages[name]['seconds']:.1f}s")
        return tensors

    def run(self) -> AloeOperator:
        with reading_tracked(self.model, self.cfg.reading_decay):  # every state collected is what the gates see
            return self._run()

    def _run(self) -> AloeOperator:
        cfg, model, tokenizer = self.cfg, self.model, self.tokenizer
        # (1) encoder + the corpus that also supplies negatives
        corpus, corpus_path = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
        self.corpus = corpus
        clock = StageClock()
        enc_dir = encoder_cache_dir(cfg, self.states_key, self.layer, corpus_path)
        enc, enc_metrics, reused = _encoder(model, tokenizer, self.layer, enc_dir, corpus, cfg)
        self.report.stage("1_encoder", clock, reused=reused, corpus=str(corpus_path), **enc_metrics)
        self.say(f"1_encoder: {'reused' if reused else 'trained'}; {_encoder_summary(enc_metrics)}")
        asked = [(s.prompt, s.subject) for s in self.slots]
        rewordings = kept_rewordings(model, tokenizer, asked, cfg, self.ckpt)
        seqs = token_sequences(tokenizer, self.slots, corpus, cfg, rewordings)
        # (2) initial addresses from the request states
        prompts = [s.prompt for s in self.slots]
        V0 = self.stage(
            "2_init", lambda: ({"V0": initial_addresses(model, tokenizer, prompts, self.layer, enc, cfg.batch_size)}, {})
        )["V0"]
        # (3) rollouts: anchors H+ and negatives H-
        pool_dir = negatives_cache_dir(cfg, self.states_key, self.layer, corpus_path)
        roll = self.stage(
            "3_rollouts",
            lambda: rollouts(
                model, tokenizer, self.slots, seqs, corpus, pool_dir, self.layer, cfg, self.rng, self.ckpt.parts("3_rollouts")
            ),
        )
        soft = seqs.seq_soft[roll["anchor_seq"]]
        if cfg.chat.chat_slots:  # slot n + i takes the chat forms of slot i, from slot i's initial address
            roll = {**roll, "anchor_owner": self.sequence_slots(seqs)[roll["anchor_seq"]]}
            V0 = torch.cat([V0, V0])
        negatives = negative_set(roll, self.base.state.anchors if self.base else None, self.n if cfg.chat.chat_slots else 0)
        same_prompt = SamePrompt.of(self.slots * (2 if cfg.chat.chat_slots else 1))
        # (4) refinement
        V = self.stage("4_refine", lambda: self.refine(V0, roll, negatives, same_prompt, soft))["V"]
        # (5) calibration
        cal = self.stage("5_calibrate", lambda: self.calibrate(V, roll, negatives, same_prompt, soft))
        gated = self.operator(V, cal, torch.zeros(V.shape[0], self.site.d_out))
        state = BuildState(roll["anchors"], roll["anchor_owner"], cal["worst_positive"], cal["worst_negative"], cfg.to_dict())
        if self.base is None:
            new = op = self.operator(V, cal, self.fit_writes(gated, roll, seqs))
        else:
            # the old slots that would open on the new states are recalibrated, then the new writes are
            # fitted with the old edits in place (their writes fixed)
            old, old_state = self.recalibrated_base(roll)
            with _patched(model, old):
                new = self.operator(V, cal, self.fit_writes(gated, roll, seqs))
            op = AloeOperator.merge([old, new])
            state = BuildState.merge([old_state, state])
        clock = StageClock()
        gates = _gate_stats(
            new, roll["anchors"], roll["anchor_owner"], [roll["pool"], roll["specific"]], self.report.stages.get("7_ridge", {})
        )
        self.report.stage("gates", clock, **gates)
        problems = self.problems()
        for line in problem_lines(problems):
            self.say(line)
        if self.out is not None and distributed.is_main():
            self.out.mkdir(parents=True, exist_ok=True)
            state.save(self.out, op)
            (self.out / "build_report.json").write_text(
                json.dumps(
                    {
                        "config": cfg.to_dict(),
                        "slots": new.n,
                        "edits": len(self.requests),
                        "problems": problems,
                        "stages": self.report.stages,
                    },
                    indent=1,
                    default=str,
                )
            )
        return op

    def problems(self) -> dict[str, list[dict[str, Any]]]:
        """The slots whose build fell short, by what went wrong: stage 5 could not separate their
        anchors from their negatives (``inseparable``), or their target is not produced greedily on
        the request after stage 6 (``unproduced_by_targets``) or in the end (``unproduced``)."""
        entries = self.entries()
        found = {
            "inseparable": self.report.stages.get("5_calibrate", {}).get("inseparable_slots", []),
            "unproduced_by_targets": self.report.stages.get("6_targets", {}).get("unproduced_slots", []),
            "unproduced": self.report.stages.get("8_finetune", {}).get("unproduced_slots", []),
        }
        return {
            kind: [
                {
                    "slot": i,
                    **{k: entries[i][k] for k in ("id", "request", "target")},
                    **({"form": "chat"} if entries[i].get("form") == "chat" else {}),
                }
                for i in slots
            ]
            for kind, slots in found.items()
        }

    def recalibrated_base(self, roll: dict[str, torch.Tensor]) -> tuple[AloeOperator, BuildState]:
        """The base operator with the slots that would open on the new anchors or continuations recalibrated."""
        old, st = self.base.op, self.base.state

        def run() -> tuple[dict[str, torch.Tensor], dict]:
            dev = self.device
            tau, alpha, s_neg, changed = s5_calibrate.recalibrate(
                old.addresses.float().to(dev),
                old.thresholds.float().to(dev),
                old.temperatures.float().to(dev),
                st.worst_positive.to(dev),
                st.worst_negative.to(dev),
                # what a one-shot build makes a negative of every slot: the new anchors and continuations
                # (a new edit's own negatives are negatives of that edit only, there as here)
                [roll[k] for k in ("anchors", "continuations")],
                old.gate_eps,
                self.cfg,
                open_at=open_at_of(old.edits, self.cfg),
            )
            return (
                {"tau": tau.cpu(), "alpha": alpha.cpu(), "worst_negative": s_neg.cpu()},
                {"old_slots": old.n, "recalibrated": int(changed.numel())},
            )

        t = self.stage("5_recalibrate_base", run)
        self.say(f"{self.report.stages['5_recalibrate_base'].get('recalibrated')} of {old.n} old slots recalibrated")
        op = AloeOperator(
            addresses=old.addresses,
            thresholds=t["tau"].to(old.dtype),
            temperatures=t["alpha"].to(old.dtype),
            writes=old.writes,
            edits=old.edits,
            **old._header(),
        )
        return op, BuildState(st.anchors, st.anchor_owner, st.worst_positive, t["worst_negative"], st.config)

    def on_device(self, V, roll, negatives, same_prompt, soft) -> tuple:
        """The inputs of stages 4-5 on the model's device (a GPU build refines there too)."""
        dev = self.device
        return (
            V.to(dev),
            roll["anchors"].to(dev),
            roll["anchor_owner"].to(dev),
            negatives.to(dev),
            same_prompt.to(dev),
            soft.to(dev),
        )

    def refine(self, V0, roll, negatives, same_prompt, soft) -> tuple[dict[str, torch.Tensor], dict]:
        V0, anchors, owner, neg, same, soft = self.on_device(V0, roll, negatives, same_prompt, soft)
        stats: dict = {}
        V, losses = s4_refine.refine_addresses(V0, anchors, owner, neg, same, self.cfg, soft, self.ckpt.parts("4_refine"), stats)
        info = {
            **stats,
            "steps": len(losses),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "loss_at_remine": losses[:: self.cfg.refine_remine_every],
            # how far refinement turned the encoder's addresses (refine_pull keeps them closer)
            "cosine_to_stage2_mean": float(torch.nn.functional.cosine_similarity(V, V0, dim=1).mean()),
        }
        return {"V": V.cpu()}, info

    def calibrate(self, V, roll, negatives, same_prompt, soft) -> tuple[dict[str, torch.Tensor], dict]:
        V, anchors, owner, neg, same, soft = self.on_device(V, roll, negatives, same_prompt, soft)
        cal = s5_calibrate.calibrate(
            V, anchors, owner, neg, same, DEFAULT_GATE_EPS, self.cfg, soft, open_at_of(self.entries(), self.cfg)
        )
        info = {
            "separable": int(cal.separable.sum()),
            "inseparable": int((~cal.separable).sum()),
            "inseparable_slots": (~cal.separable).nonzero().squeeze(1).tolist(),
        }
        return {
            "tau": cal.thresholds.cpu(),
            "alpha": cal.temperatures.cpu(),
            "separable": cal.separable.to(torch.uint8).cpu(),
            "worst_positive": cal.worst_positive.cpu(),
            "worst_negative": cal.worst_negative.cpu(),
        }, info

    def entries(self) -> list[dict[str, Any]]:
        """The operator's metadata: one entry per request slot, then with chat slots one per chat slot."""
        edits = [
            {"id": s.ids[0], "ids": s.ids, "request": s.prompt, "target": s.target, "subject": s.subject} for s in self.slots
        ]
        return edits + chat_entries(edits) if self.cfg.chat.chat_slots else edits

    def sequence_slots(self, seqs: TokenSequences) -> torch.Tensor:
        """The slot of every anchor sequence: its edit's request slot, and with chat slots a chat form's
        chat slot n + i."""
        return chat_slot_owner(seqs.seq_owner, seqs.seq_chat, self.n) if self.cfg.chat.chat_slots else seqs.seq_owner

    def operator(self, V: torch.Tensor, cal: dict[str, torch.Tensor], writes: torch.Tensor) -> AloeOperator:
        return AloeOperator(
            addresses=V,
            thresholds=cal["tau"],
            temperatures=cal["alpha"],
            writes=writes,
            eps=DEFAULT_EPS,
            gate_eps=DEFAULT_GATE_EPS,
            edits=self.entries(),
            layer=self.layer,
            module_path=self.site.path,
            base_model=model_name(self.model),
            weight_fingerprint=self.fingerprint,
            reading_decay=self.cfg.reading_decay,
        )

    def fit_writes(self, gated: AloeOperator, roll: dict[str, torch.Tensor], seqs: TokenSequences) -> torch.Tensor:
        """Stages 6-8: write targets, the joint ridge solve and the NLL fine-tuning of the writes."""
        cfg, n = self.cfg, self.n
        # training sequences: the requests (sequence i = slot i), the chat forms, then the rewordings and the first
        # positives_prefixed_written context positives whose own gate opens at their last prompt token
        # (a write cannot reach a closed one)
        optional = seqs.seq_soft | seqs.prefixed_mask(cfg.positives_prefixed_written)
        opened = _open_paraphrases(gated, roll["anchors"], roll["anchor_seq"], seqs.seq_owner, optional)
        train_seqs = list(range(n)) + seqs.trained + opened
        train_owner = self.sequence_slots(seqs)[train_seqs].tolist()  # chat forms train their chat slot's write
        all_prompts = seqs.prompts + seqs.extra_prompts
        target_lens = [min(len(seqs.target(j)), cfg.max_target_tokens) for j in train_seqs]
        tseqs = [all_prompts[j] + seqs.target(j)[: cfg.max_target_tokens] for j in train_seqs]
        # one pass up to the edited layer, shared by stages 6 and 8 when both run; stage 8 also keeps
        # the answers after each edit's statement (sequences after the training ones, no target of their own)
        shared: list[EditedForward] = []

        def forward() -> EditedForward:
            if not shared:
                keeps = statement_keeps(self.model, self.tokenizer, self.slots, self.corpus, self.layer, cfg)
                owners = train_owner + keeps.owners
                # a distributed build's rank runs the sequences of its share of the edits (and their chat slots)
                mine = distributed.share(n)
                held = [k for k, o in enumerate(owners) if o % n in mine] if distributed.active() else None
                shared.append(
                    edited_forward(
                        self.model, self.tokenizer, tseqs + keeps.seqs, target_lens + keeps.answer_lens, owners, gated, cfg, held
                    )
                )
            return shared[0]

        # what each slot's write target is fitted on: its request (row i), and with target_chat_forms its chat
        # forms; a chat slot's, on its chat forms
        rows_of = [[i] for i in range(n)] + [[] for _ in range(gated.n - n)]
        if cfg.chat.target_chat_forms or cfg.chat.chat_slots:
            chat = set(seqs.trained)
            for k, (j, owner) in enumerate(zip(train_seqs, train_owner)):
                if j in chat:
                    rows_of[owner].append(k)

        def targets() -> tuple[dict[str, torch.Tensor], dict]:
            steps: dict = {}
            deltas, nll, produced = write_targets(forward(), cfg, self.ckpt.parts("6_targets"), rows_of, steps)
            return {"Y": deltas}, {"nll_mean": sum(nll) / len(nll), "nll_max": max(nll), "produced": produced, **steps}

        Y = self.stage("6_targets", targets)["Y"]
        negatives = [roll["pool"], roll["specific"]]

        def ridge() -> tuple[dict[str, torch.Tensor], dict]:
            tally = NegativeGateTally()
            U0 = ridge_writes(Y, roll["anchors"], roll["anchor_owner"], negatives, gated, cfg, tally)
            return {"U0": U0}, tally.summary()

        U0 = self.stage("7_ridge", ridge)["U0"]

        def finetune() -> tuple[dict[str, torch.Tensor], dict]:
            fwd = forward()
            U, losses = finetune_writes(fwd, U0, cfg)
            # requests only (sequence i < n is slot i's request), with every slot's write in place
            made = produced_rows(fwd, U, range(n), cfg.finetune_batch)
            kept = produced_rows(fwd, U, range(len(tseqs), len(fwd.seqs)), cfg.finetune_batch)
            return {"U": U}, {
                "keep_sequences": len(kept),
                "kept": sum(kept) / len(kept) if kept else None,
                "steps": len(losses),
                "nll_first": losses[0] if losses else None,
                "nll_last": losses[-1] if losses else None,
                "produced": sum(made) / n,
                "unproduced_slots": [i for i, ok in enumerate(made) if not ok],
                "paraphrase_sequences": len(train_seqs) - n,
            }

        return self.stage("8_finetune", finetune)["U"]


def problem_lines(problems: dict[str, list[dict[str, Any]]], show: int = 5) -> list[str]:
    """What a build says at its end about :meth:`_Build.problems`: a count and the first few slots
    of each kind (all of them are in ``build_report.json``)."""
    what = {
        "inseparable": "slots stage 5 could not separate from their negatives",
        "unproduced_by_targets": "edits whose target stage 6 did not produce",
        "unproduced": "edits whose target the operator does not produce on the request",
    }
    lines = []
    for kind, slots in problems.items():
        if slots:
            shown = "; ".join(f"{s['id']}: {s['request']!r} -> {s['target']!r}" for s in slots[:show])
            more = f"; and {len(slots) - show} more" if len(slots) > show else ""
            lines.append(f"WARNING: {len(slots)} {what[kind]}: {shown}{more} (build_report.json: problems.{kind})")
    return lines


@contextlib.contextmanager
def _patched(model, op: AloeOperator) -> Iterator[None]:
    """Within the context ``model`` carries ``op`` (an append fits its writes beside the old edits)."""
    apply_aloe(model, op)
    try:
        yield
    finally:
        remove_aloe(model)


def _open_paraphrases(
    op: AloeOperator,
    anchors: torch.Tensor,
    anchor_seq: torch.Tensor,
    seq_owner: torch.Tensor,
    candidate: torch.Tensor,
    at_least: float = 0.5,
) -> list[int]:
    """The ``candidate`` sequences whose owner's gate is at least ``at_least`` on their first
    anchor, the last prompt token."""
    first = torch.ones_like(anchor_seq, dtype=torch.bool)
    first[1:] = anchor_seq[1:] != anchor_seq[:-1]
    rows = (first & candidate[anchor_seq]).nonzero().squeeze(1)
    if rows.numel() == 0:
        return []
    seqs = anchor_seq[rows]
    g = gates_of(anchors[rows], op)[torch.arange(rows.numel()), seq_owner[seqs]]
    return seqs[g >= at_least].tolist()


def _gate_stats(op: AloeOperator, anchors, anchor_owner, negatives, ridge_report: dict[str, Any]) -> dict[str, float]:
    """Each anchor's gate at its own slot, and how the negatives open gates: counted by stage 7,
    which gates every negative at every slot with the same addresses and calibration (a build
    resumed from a stage-7 checkpoint without those counts gates them again)."""
    # in float64: a steep gate (a slot calibrated over a narrow gap) turns float32 rounding of the
    # scores into visible differences of the gates reported
    V, tau, alpha = (t.double() for t in (op.addresses, op.thresholds, op.temperatures))
    own = gates_from_scores((anchors.double() * V[anchor_owner]).sum(-1), tau[anchor_owner], alpha[anchor_owner], op.gate_eps)
    tally = NegativeGateTally()
    negative = {k: ridge_report[k] for k in tally.summary() if k in ridge_report}
    if negative.keys() != tally.summary().keys():
        for g in open_gates(negatives, op):
            tally.add(g)
        negative = tally.summary()
    return {
        "anchor_own_gate_median": float(own.median()),
        "anchor_own_gate_min": float(own.min()),
        "anchor_open_share": float((own > 0).double().mean()),
        **negative,
    }
