"""Stage 1: the address encoder (paper Sec. "Learning the semantic boundary").

Two linear maps Q, K (p x d) and a scale c score a query state against an
edit's key: s(x, t) = c <Q h(x), norm(K h(t))>, on normalized states h. The
address of edit i is then v_i = c Q^T norm(K h(t_i)), so v_i^T h(x) = s(x, t_i).

Training uses relation-balanced minibatches of construction items and
- an in-batch ranking loss in both directions (each paraphrase against the
  other keys, each key against the other queries and its hard negatives),
- squared-hinge margins of the paraphrase over its locality input and over
  same-subject other-relation prompts,
- an orthogonality penalty on the keys.
Encoders are cached per (model weight, layer, corpus, settings).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .checkpoints import save_tensors_atomically, write_atomically
from .config import BuildConfig
from .corpus import CORPUS_VERSION, Corpus
from .states import last_token_states


@dataclass
class AddressEncoder:
    """Q, K (p x d) and log c."""

    Q: torch.Tensor
    K: torch.Tensor
    log_c: torch.Tensor

    @property
    def c(self) -> float:
        return float(self.log_c.exp())

    def keys(self, h: torch.Tensor) -> torch.Tensor:
        return F.normalize(h @ self.K.T, dim=-1)

    def addresses(self, h_requests: torch.Tensor) -> torch.Tensor:
        """v_i = c Q^T norm(K h(t_i)) for normalized request states (n, d) -> (n, d)."""
        return self.log_c.exp() * (self.keys(h_requests) @ self.Q)

    def scores(self, h_queries: torch.Tensor, h_requests: torch.Tensor) -> torch.Tensor:
        return h_queries @ self.addresses(h_requests).T

    def save(self, path: Path, metrics: dict) -> None:
        """Atomically, metrics first: a build that finds encoder.safetensors finds a whole encoder,
        even while another build is writing the same cache entry."""
        path.mkdir(parents=True, exist_ok=True)
        write_atomically(path / "encoder.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1)))
        save_tensors_atomically({"Q": self.Q.contiguous(), "K": self.K.contiguous(), "log_c": self.log_c.reshape(1)},
                                path / "encoder.safetensors")

    @classmethod
    def load(cls, path: Path) -> tuple["AddressEncoder", dict]:
        from safetensors.torch import load_file

        t = load_file(str(path / "encoder.safetensors"))
        return cls(t["Q"], t["K"], t["log_c"].reshape(())), json.loads((path / "encoder.json").read_text())


@dataclass
class CorpusStates:
    """Normalized last-token states of every corpus prompt."""

    request: torch.Tensor  # (N, d)
    paraphrase: torch.Tensor  # (N, d)
    locality: torch.Tensor  # (N, d)
    same_subject: torch.Tensor  # (N, S, d)


def corpus_states(model, tokenizer, corpus: Corpus, layer: int, batch_size: int) -> CorpusStates:
    items = corpus.items
    S = min(len(it.same_subject) for it in items)
    texts = [it.request for it in items] + [it.paraphrase for it in items] + [it.locality for it in items]
    texts += [p for it in items for p in it.same_subject[:S]]
    h = last_token_states(model, tokenizer, texts, layer, batch_size, desc="encoder corpus states")
    N = len(items)
    return CorpusStates(h[:N], h[N:2 * N], h[2 * N:3 * N], h[3 * N:].reshape(N, S, h.shape[1]))


def split_groups(corpus: Corpus, dev_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Train/dev item indices with disjoint relation groups (held-out predicates)."""
    groups = sorted({it.group for it in corpus.items})
    rng = random.Random(seed)
    rng.shuffle(groups)
    dev_groups = set(groups[: max(1, int(len(groups) * dev_fraction))])
    train = [i for i, it in enumerate(corpus.items) if it.group not in dev_groups]
    dev = [i for i, it in enumerate(corpus.items) if it.group in dev_groups]
    return train, dev


def _balanced_batches(groups: list[str], batch: int, rng: random.Random):
    """Endless minibatches: sample a relation group uniformly, then an item of it."""
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    keys = list(by_group)
    while True:
        chosen: set[int] = set()
        while len(chosen) < min(batch, len(groups)):
            chosen.add(rng.choice(by_group[rng.choice(keys)]))
        yield sorted(chosen)


def train_encoder(cs: CorpusStates, groups: list[str], idx: list[int], cfg: BuildConfig) -> AddressEncoder:
    """Fit Q, K, c on the items ``idx``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    d = cs.request.shape[1]
    p = cfg.encoder_dim
    Q = (torch.randn(p, d, generator=gen) / d**0.5).requires_grad_(True)
    K = (torch.randn(p, d, generator=gen) / d**0.5).requires_grad_(True)
    log_c = torch.tensor(2.0, requires_grad=True)
    opt = torch.optim.AdamW([Q, K, log_c], lr=cfg.encoder_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    sub_groups = [groups[i] for i in idx]
    batches = _balanced_batches(sub_groups, cfg.encoder_batch, rng)
    m = cfg.encoder_margin
    bar = tqdm(range(cfg.encoder_steps), desc="stage 1: address encoder", leave=False)
    for _ in bar:
        b = torch.tensor([idx[j] for j in next(batches)])
        B = len(b)
        c = log_c.exp()
        k = F.normalize(cs.request[b] @ K.T, dim=-1)  # (B, p)
        q_pos = cs.paraphrase[b] @ Q.T
        q_loc = cs.locality[b] @ Q.T
        q_ss = cs.same_subject[b] @ Q.T  # (B, S, p)
        s_pp = c * q_pos @ k.T  # (B queries, B keys)
        s_pos = s_pp.diagonal()
        s_loc = c * (q_loc * k).sum(-1)
        s_ss = c * torch.einsum("bsp,bp->bs", q_ss, k)
        target = torch.arange(B)
        rank_q = F.cross_entropy(s_pp, target)  # each paraphrase picks its own key
        key_logits = torch.cat([s_pp.T, s_loc[:, None], s_ss], dim=1)  # each key picks its own paraphrase
        rank_k = F.cross_entropy(key_logits, target)
        margin = (F.relu(m + s_loc - s_pos) ** 2).mean() + (F.relu(m + s_ss - s_pos[:, None]) ** 2).mean()
        gram = k @ k.T
        ortho = ((gram - torch.eye(B)) ** 2).sum() / (B * (B - 1))
        loss = rank_q + rank_k + margin + cfg.encoder_ortho * ortho
        if not torch.isfinite(loss):
            raise FloatingPointError("stage 1 (address encoder): loss became NaN/Inf")
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    return AddressEncoder(Q.detach(), K.detach(), log_c.detach())


def raw_control(cs: CorpusStates, idx: list[int], p: int) -> AddressEncoder:
    """The equal-dimension raw-activation control: Q = K = top-p principal directions, c = 1."""
    X = torch.cat([cs.request[idx], cs.paraphrase[idx]])
    X = X - X.mean(0)
    _, _, Vh = torch.linalg.svd(X, full_matrices=False)
    P = Vh[:p]
    return AddressEncoder(P.clone(), P.clone(), torch.tensor(0.0))


def _auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    scores = torch.cat([pos, neg])
    ranks = scores.argsort().argsort().double() + 1
    n_pos, n_neg = len(pos), len(neg)
    return float((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def encoder_diagnostics(enc: AddressEncoder, cs: CorpusStates, dev: list[int], same_subject_16: torch.Tensor | None
                        ) -> dict[str, float]:
    """The paper's mechanism analysis on held-out-predicate items.

    - scope_auc: paraphrase score vs the key's negatives (locality, same-subject, other items' queries);
    - recall: share of paraphrases above the key's calibration threshold (its worst construction
      negative: locality and same-subject prompts, as stage 5 would calibrate);
    - same_subject_top1: the paraphrase ranks its own key first among 16 keys of the same subject
      under different relations (needs ``same_subject_16``: (N, 15, d) states);
    - negative_fpr: share of unseen negatives (other items' paraphrases and locality inputs) above
      that threshold.
    """
    b = torch.tensor(dev)
    addr = enc.addresses(cs.request[b])  # (N, d)
    s_pos = (cs.paraphrase[b] * addr).sum(-1)
    s_loc = (cs.locality[b] * addr).sum(-1)
    s_ss = torch.einsum("nsd,nd->ns", cs.same_subject[b], addr)
    theta = torch.maximum(s_loc, s_ss.max(1).values)
    others = torch.cat([cs.paraphrase[b], cs.locality[b]])  # (2N, d)
    s_other = others @ addr.T  # (2N, N)
    N = len(dev)
    own = torch.zeros_like(s_other, dtype=torch.bool)
    own[torch.arange(N), torch.arange(N)] = True
    own[N + torch.arange(N), torch.arange(N)] = True
    unseen = s_other.masked_select(~own)
    unseen_key = torch.arange(N).expand(2 * N, N).masked_select(~own)
    neg_all = torch.cat([s_loc, s_ss.reshape(-1), unseen])
    out = {
        "scope_auc": _auc(s_pos, neg_all),
        "recall": float((s_pos > theta).double().mean()),
        "negative_fpr": float((unseen > theta[unseen_key]).double().mean()),
        "items": N,
    }
    if same_subject_16 is not None:
        keys16 = torch.cat([cs.request[b][:, None], same_subject_16], 1)  # (N, 16, d)
        a16 = enc.log_c.exp() * (F.normalize(keys16 @ enc.K.T, dim=-1) @ enc.Q)  # (N, 16, d)
        s16 = torch.einsum("nkd,nd->nk", a16, cs.paraphrase[b])
        out["same_subject_top1"] = float((s16.argmax(1) == 0).double().mean())
    return out


def cache_key(fingerprint: str, layer: int, corpus_path: Path, cfg: BuildConfig) -> str:
    """Key of an encoder in the cache: model weight, layer, corpus and the stage-1 settings (not the cache's place)."""
    fields = {k: v for k, v in cfg.fields_of(1).items() if k != "encoder_cache"}
    h = hashlib.sha256()
    h.update(json.dumps([fingerprint, layer, str(Path(corpus_path).resolve()), corpus_path.stat().st_size,
                         fields, cfg.seed, CORPUS_VERSION], sort_keys=True).encode())
    return h.hexdigest()[:16]


DIAGNOSTIC_ITEMS = 200  # held-out items scored (each needs 15 extra same-subject prompts)


def build_encoder(model, tokenizer, corpus: Corpus, layer: int, cfg: BuildConfig) -> tuple[AddressEncoder, dict]:
    """Collect corpus states, train on held-in predicates, report diagnostics on held-out ones,
    then return the encoder with its metrics (learned vs raw control)."""
    cs = corpus_states(model, tokenizer, corpus, layer, cfg.batch_size)
    groups = [it.group for it in corpus.items]
    train, dev = split_groups(corpus, 0.1, cfg.seed)
    enc = train_encoder(cs, groups, train, cfg)
    rng = random.Random(cfg.seed + 1)
    dev16 = None
    dev = dev[:DIAGNOSTIC_ITEMS]
    if dev:
        texts = []
        for i in dev:
            it = corpus.items[i]
            texts += corpus.other_relation_prompts(it.subject, it.group, 15, rng)
        if len(texts) == 15 * len(dev):
            dev16 = last_token_states(model, tokenizer, texts, layer, cfg.batch_size,
                                      desc="encoder diagnostics").reshape(len(dev), 15, -1)
    metrics = {
        "train_items": len(train),
        "learned": encoder_diagnostics(enc, cs, dev, dev16) if dev else {},
        "raw_control": encoder_diagnostics(raw_control(cs, train, cfg.encoder_dim), cs, dev, dev16) if dev else {},
        "c": enc.c,
    }
    return enc, metrics
