"""The address mechanism on its own (paper Sec. "Mechanism evidence"): partitions and metrics.

Two protocols split a construction corpus into train / calibration / development items:

- ``subject``: the paper's. Every relation appears in all three parts; subjects are disjoint
  across parts, and no development surface (request, paraphrase, locality prompt) is a
  training prompt.
- ``relation``: harder. Relation groups are disjoint across parts, so the development items ask
  about relations the encoder never saw.

The metrics score development items with a threshold transferred from the calibration part:

- ``scope_auc``: paraphrases on their own keys against the keys' negatives, the mean of the AUCs
  of three kinds (``auc_locality``: each key's locality input; ``auc_same_subject``: its
  same-subject other-relation prompts; ``auc_others``: other items' paraphrases and locality inputs);
- ``recall``: share of development paraphrases above the transferred threshold;
- ``negative_fpr``: the mean over the three kinds of the share of negatives above it (``fpr_<kind>``);
- ``same_subject_top1``: the paraphrase ranks its own key first among 16 keys of the same
  subject (its request and 15 other-relation prompts).

The threshold is the one that maximizes recall minus the mean false-positive rate on the
calibration part. A second rule, reported beside it (``recall_at_budget``, ``negative_fpr_at_budget``),
takes the lowest threshold whose mean false-positive rate on the calibration part is at most
:data:`FPR_BUDGET`: the most recall a fixed false-positive budget allows, the rule under which a
control that only ranks poorly cannot buy recall by opening on most negatives.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from .config import BuildConfig
from .corpus import Corpus
from .stages.s1_encoder import AddressEncoder, CorpusStates, corpus_states, raw_control, train_encoder
from .states import last_token_states

PROTOCOLS = ("subject", "relation")
SAME_SUBJECT_KEYS = 15  # other-relation keys per development item: 16-way top-1 with its own
FPR_BUDGET = 0.05  # mean calibration false-positive rate allowed by the second threshold rule


@dataclass
class Partition:
    """Item indices of a corpus: train, calibration, development."""

    protocol: str
    train: list[int]
    calibration: list[int]
    dev: list[int]


def subject_partition(corpus: Corpus, n_dev: int, n_cal: int, seed: int) -> Partition:
    """Subject-disjoint parts of about ``n_dev`` and ``n_cal`` items (whole subjects), relations shared;
    training drops items whose request or paraphrase is a development prompt."""
    by_subject: dict[str, list[int]] = {}
    for i, it in enumerate(corpus.items):
        by_subject.setdefault(it.subject, []).append(i)
    subjects = sorted(by_subject)
    random.Random(seed).shuffle(subjects)
    dev: list[int] = []
    cal: list[int] = []
    train: list[int] = []
    for s in subjects:
        part = dev if len(dev) < n_dev else cal if len(cal) < n_cal else train
        part.extend(by_subject[s])
    surfaces = {t for i in dev for t in _surfaces(corpus, i)}
    train = [i for i in train if not surfaces.intersection(_surfaces(corpus, i)[:2])]
    return Partition("subject", sorted(train), sorted(cal), sorted(dev))


def relation_partition(corpus: Corpus, fraction: float, n_dev: int, seed: int) -> Partition:
    """Relation-disjoint parts: ``fraction`` of the relation groups for development, as many for
    calibration, the rest for training; development keeps at most ``n_dev`` items."""
    groups = sorted({it.group for it in corpus.items})
    random.Random(seed).shuffle(groups)
    k = max(1, int(len(groups) * fraction))
    if len(groups) < 2 * k + 1:
        raise ValueError(f"relation protocol: {len(groups)} relation groups cannot make three disjoint parts")
    dev_g, cal_g = set(groups[:k]), set(groups[k : 2 * k])
    dev = [i for i, it in enumerate(corpus.items) if it.group in dev_g]
    cal = [i for i, it in enumerate(corpus.items) if it.group in cal_g]
    train = [i for i, it in enumerate(corpus.items) if it.group not in dev_g | cal_g]
    dev = sorted(random.Random(seed + 1).sample(dev, min(n_dev, len(dev))))
    return Partition("relation", train, cal, dev)


def partition(corpus: Corpus, protocol: str, n_dev: int, seed: int) -> Partition:
    """The named protocol's partition (calibration as large as development)."""
    if protocol == "subject":
        return subject_partition(corpus, n_dev, n_dev, seed)
    if protocol == "relation":
        return relation_partition(corpus, 0.2, n_dev, seed)
    raise ValueError(f"unknown mechanism protocol {protocol!r}; choose from {PROTOCOLS}")


def _surfaces(corpus: Corpus, i: int) -> tuple[str, str, str]:
    it = corpus.items[i]
    return it.request, it.paraphrase, it.locality


def same_subject_key_prompts(corpus: Corpus, idx: list[int], seed: int) -> list[list[str]]:
    """Per item, :data:`SAME_SUBJECT_KEYS` fixed prompts about its subject under other relations."""
    rng = random.Random(seed)
    return [corpus.other_relation_prompts(corpus.items[i].subject, corpus.items[i].group, SAME_SUBJECT_KEYS, rng) for i in idx]


@dataclass
class ScoredItems:
    """Scores of items' paraphrases on their own keys, and of each key's negatives by kind."""

    positive: torch.Tensor  # (N,)
    locality: torch.Tensor  # (N,)
    same_subject: torch.Tensor  # (N, S)
    others: torch.Tensor  # (N, 2N - 2): other items' paraphrases and locality inputs on this key

    def negatives(self) -> dict[str, torch.Tensor]:
        return {"locality": self.locality, "same_subject": self.same_subject.reshape(-1), "others": self.others.reshape(-1)}


def score_items(
    addresses: torch.Tensor, paraphrase: torch.Tensor, locality: torch.Tensor, same_subject: torch.Tensor
) -> ScoredItems:
    """Scores of N items from their addresses (N, d) and normalized states: paraphrases and
    locality inputs (N, d), same-subject prompts (N, S, d)."""
    N = len(addresses)
    s_other = addresses @ torch.cat([paraphrase, locality]).T  # (N keys, 2N queries)
    own = torch.zeros_like(s_other, dtype=torch.bool)
    own[torch.arange(N), torch.arange(N)] = True
    own[torch.arange(N), N + torch.arange(N)] = True
    return ScoredItems(
        positive=(paraphrase * addresses).sum(-1),
        locality=(locality * addresses).sum(-1),
        same_subject=torch.einsum("nsd,nd->ns", same_subject, addresses),
        others=s_other.masked_select(~own).reshape(N, 2 * N - 2),
    )


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """Probability that a positive outscores a negative (ties count half)."""
    pos, neg = pos.double().sort().values, neg.double().sort().values
    below = torch.searchsorted(neg, pos, right=False).double()
    not_above = torch.searchsorted(neg, pos, right=True).double()
    return float(((below + not_above) / 2).sum() / (len(pos) * len(neg)))


def _rates(scores: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Share of ``scores`` above each threshold."""
    s = scores.double().sort().values
    return (len(s) - torch.searchsorted(s, thresholds, right=True)).double() / len(s)


def _candidate_rates(pos: torch.Tensor, negatives: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Every score as a candidate threshold, with the recall and the mean false-positive rate at each."""
    cand = torch.cat([pos, *negatives.values()]).double().unique()
    fpr = torch.stack([_rates(n, cand) for n in negatives.values()]).mean(0)
    return cand, _rates(pos, cand), fpr


def transferred_threshold(pos: torch.Tensor, negatives: dict[str, torch.Tensor]) -> float:
    """The threshold (fire when score > it) maximizing recall minus the mean false-positive rate
    of the negative kinds, on calibration scores."""
    cand, recall, fpr = _candidate_rates(pos, negatives)
    return float(cand[(recall - fpr).argmax()])


def budget_threshold(pos: torch.Tensor, negatives: dict[str, torch.Tensor], budget: float = FPR_BUDGET) -> float:
    """The lowest threshold (fire when score > it) whose mean false-positive rate over the negative
    kinds is at most ``budget``, on calibration scores (the highest score always qualifies)."""
    cand, _, fpr = _candidate_rates(pos, negatives)
    return float(cand[fpr <= budget].min())


def _at_threshold(dev: ScoredItems, threshold: float) -> tuple[float, dict[str, float]]:
    """Recall and each negative kind's false-positive rate at ``threshold``."""
    thr = torch.tensor([threshold], dtype=torch.double)
    return float(_rates(dev.positive, thr)), {k: float(_rates(n, thr)) for k, n in dev.negatives().items()}


def mechanism_metrics(
    dev: ScoredItems, threshold: float, same_subject_16: torch.Tensor | None, threshold_at_budget: float | None = None
) -> dict[str, float]:
    """The metrics on development scores; AUC and FPR average the three negative kinds (each also
    reported). ``same_subject_16``: (N, 16) scores of each paraphrase on its own key (column 0)
    and 15 same-subject other-relation keys. With ``threshold_at_budget``, recall and mean FPR at
    that threshold too."""
    negatives = dev.negatives()
    recall, fprs = _at_threshold(dev, threshold)
    out: dict[str, float] = {"recall": recall}
    for kind, neg in negatives.items():
        out[f"auc_{kind}"] = auc(dev.positive, neg)
        out[f"fpr_{kind}"] = fprs[kind]
    out["scope_auc"] = sum(out[f"auc_{k}"] for k in negatives) / len(negatives)
    out["negative_fpr"] = sum(fprs.values()) / len(fprs)
    if same_subject_16 is not None:
        out["same_subject_top1"] = float((same_subject_16.argmax(1) == 0).double().mean())
    if threshold_at_budget is not None:
        recall_b, fprs_b = _at_threshold(dev, threshold_at_budget)
        out.update(
            recall_at_budget=recall_b,
            negative_fpr_at_budget=sum(fprs_b.values()) / len(fprs_b),
            threshold_at_budget=threshold_at_budget,
        )
    out.update(threshold=threshold, items=len(dev.positive))
    return out


def key_scores(
    addresses_of: Callable[[torch.Tensor], torch.Tensor], paraphrase: torch.Tensor, keys16: torch.Tensor
) -> torch.Tensor:
    """(N, 16) scores of each paraphrase (N, d) on the addresses of its 16 key states (N, 16, d);
    ``addresses_of`` maps normalized key states (M, d) to addresses (M, d)."""
    a16 = addresses_of(keys16.reshape(-1, keys16.shape[-1])).reshape(keys16.shape)
    return torch.einsum("nkd,nd->nk", a16, paraphrase)


def evaluate_addresses(
    addresses_of: Callable[[torch.Tensor], torch.Tensor], states: CorpusStates, part: Partition, dev_keys: torch.Tensor | None
) -> dict[str, float]:
    """Metrics of an address map on ``part``: threshold from the calibration items, scores of the
    development items; ``dev_keys``: (len(part.dev), 15, d) same-subject key states, or None."""

    def scored(idx: list[int]) -> ScoredItems:
        b = torch.tensor(idx)
        return score_items(addresses_of(states.request[b]), states.paraphrase[b], states.locality[b], states.same_subject[b])

    cal = scored(part.calibration)
    threshold = transferred_threshold(cal.positive, cal.negatives())
    threshold_at_budget = budget_threshold(cal.positive, cal.negatives())
    s16 = None
    if dev_keys is not None:
        b = torch.tensor(part.dev)
        s16 = key_scores(addresses_of, states.paraphrase[b], torch.cat([states.request[b][:, None], dev_keys], 1))
    return mechanism_metrics(scored(part.dev), threshold, s16, threshold_at_budget)


def protocol_metrics(
    cs: CorpusStates, corpus: Corpus, part: Partition, dev_keys: torch.Tensor | None, cfg: BuildConfig
) -> dict[str, dict[str, float]]:
    """A learned encoder (trained on ``part.train`` with ``cfg``) and the equal-dimension raw control,
    each scored on ``part``."""
    groups = [it.group for it in corpus.items]
    learned = train_encoder(cs, groups, part.train, cfg)
    raw = raw_control(cs, part.train, cfg.encoder_dim)
    return {
        "learned": evaluate_addresses(learned.addresses, cs, part, dev_keys),
        "raw_control": evaluate_addresses(raw.addresses, cs, part, dev_keys),
    }


def dev_key_states(
    model,
    tokenizer,
    corpus: Corpus,
    part: Partition,
    layer: int,
    cfg: BuildConfig,
) -> torch.Tensor | None:
    """(len(part.dev), 15, d) states of the development items' same-subject keys, or None when
    the corpus has too few relations to make 15 for every item."""
    prompts = same_subject_key_prompts(corpus, part.dev, cfg.seed + 1)
    if not part.dev or any(len(p) < SAME_SUBJECT_KEYS for p in prompts):
        return None
    h = last_token_states(
        model, tokenizer, [t for p in prompts for t in p], layer, cfg.batch_size, desc=f"encoder {part.protocol} keys"
    )
    return h.reshape(len(part.dev), SAME_SUBJECT_KEYS, -1)


BUILD_DIAGNOSTIC_ITEMS = 200  # at most, development items per protocol in a build's report (15 key prompts each)


def build_encoder(model, tokenizer, corpus: Corpus, layer: int, cfg: BuildConfig) -> tuple[AddressEncoder, dict]:
    """The deployed encoder, trained on every corpus item, and its report: each protocol's
    learned-vs-raw metrics from encoders trained on that protocol's training part."""
    cs = corpus_states(model, tokenizer, corpus, layer, cfg.batch_size)
    groups = [it.group for it in corpus.items]
    enc = train_encoder(cs, groups, list(range(len(corpus.items))), cfg)
    metrics: dict = {"train_items": len(corpus.items), "c": enc.c}
    for protocol in PROTOCOLS:
        try:
            part = partition(corpus, protocol, min(BUILD_DIAGNOSTIC_ITEMS, len(corpus.items) // 5), cfg.seed)
        except ValueError as e:  # a corpus of too few relations has no relation protocol
            metrics[protocol] = {"skipped": str(e)}
            continue
        if not (part.train and part.calibration and part.dev):
            metrics[protocol] = {"skipped": "a part of the partition is empty"}
            continue
        keys = dev_key_states(model, tokenizer, corpus, part, layer, cfg)
        metrics[protocol] = protocol_metrics(cs, corpus, part, keys, cfg)
    return enc, metrics


__all__ = [
    "FPR_BUDGET",
    "PROTOCOLS",
    "Partition",
    "ScoredItems",
    "auc",
    "budget_threshold",
    "build_encoder",
    "dev_key_states",
    "evaluate_addresses",
    "key_scores",
    "mechanism_metrics",
    "partition",
    "protocol_metrics",
    "same_subject_key_prompts",
    "score_items",
    "transferred_threshold",
]
