"""Stage 1: the address encoder (paper Sec. "Learning the semantic boundary").

Two linear maps Q, K (p x d) and a scale c score a query state against an
edit's key: s(x, t) = c <Q h(x), norm(K h(t))>, on normalized states h. The
address of edit i is then v_i = c Q^T norm(K h(t_i)), so v_i^T h(x) = s(x, t_i).

Training uses relation-balanced minibatches of construction items and
- an in-batch ranking loss in both directions (each paraphrase against the
  other keys, each key against the other queries and its hard negatives, or
  with ``encoder_batch_negatives`` the whole batch's),
- squared-hinge margins of the paraphrase over its locality input and over
  same-subject other-relation prompts,
- an orthogonality penalty on the keys,
- with ``encoder_threshold_weight``, a logistic loss of every score of the
  batch against one learned threshold.
With ``encoder_dropout``, each step sees its batch's states with that share of
their coordinates zeroed and renormalized (a regularizer: the maps fit their
training items much better than new ones without it). With ``encoder_members``,
several encoders are trained from different seeds and an edit's address is the
mean of theirs.
Encoders are cached per (model weight, layer, corpus, settings).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..checkpoints import file_sha256, save_tensors_atomically, write_atomically
from ..config import BuildConfig
from ..corpus import CORPUS_VERSION, Corpus
from ..states import last_token_states


@dataclass
class AddressEncoder:
    """Q, K (p x d) and log c of each member: (E, p, d), (E, p, d), (E,). With several members
    (``encoder_members``) an address is the mean of the members' addresses."""

    Q: torch.Tensor
    K: torch.Tensor
    log_c: torch.Tensor

    def __post_init__(self) -> None:
        if self.Q.dim() == 2:  # one member given as (p, d), as saved before members existed
            self.Q, self.K, self.log_c = self.Q[None], self.K[None], self.log_c.reshape(1)

    @property
    def members(self) -> int:
        return self.Q.shape[0]

    @property
    def c(self) -> float:
        """The members' mean scale."""
        return float(self.log_c.exp().mean())

    def keys(self, h: torch.Tensor) -> torch.Tensor:
        """Each member's normalized keys of states (n, d): (E, n, p)."""
        return F.normalize(torch.einsum("epd,nd->enp", self.K, h), dim=-1)

    def addresses(self, h_requests: torch.Tensor) -> torch.Tensor:
        """v_i = mean over members of c Q^T norm(K h(t_i)), for normalized request states (n, d) -> (n, d)."""
        weights = self.log_c.exp() / self.members
        return torch.einsum("e,enp,epd->nd", weights, self.keys(h_requests), self.Q)

    def scores(self, h_queries: torch.Tensor, h_requests: torch.Tensor) -> torch.Tensor:
        return h_queries @ self.addresses(h_requests).T

    def save(self, path: Path, metrics: dict) -> None:
        """Atomically, metrics first: a build that finds encoder.safetensors finds a whole encoder,
        even while another build is writing the same cache entry."""
        path.mkdir(parents=True, exist_ok=True)
        write_atomically(path / "encoder.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1)))
        save_tensors_atomically(
            {"Q": self.Q.contiguous(), "K": self.K.contiguous(), "log_c": self.log_c.contiguous()}, path / "encoder.safetensors"
        )

    @classmethod
    def load(cls, path: Path) -> tuple["AddressEncoder", dict]:
        from safetensors.torch import load_file

        t = load_file(str(path / "encoder.safetensors"))
        return cls(t["Q"], t["K"], t["log_c"]), json.loads((path / "encoder.json").read_text())


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
    return CorpusStates(h[:N], h[N : 2 * N], h[2 * N : 3 * N], h[3 * N :].reshape(N, S, h.shape[1]))


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


def batch_loss(
    cs: CorpusStates,
    b: torch.Tensor,
    Q: torch.Tensor,
    K: torch.Tensor,
    log_c: torch.Tensor,
    threshold: torch.Tensor,
    cfg: BuildConfig,
) -> torch.Tensor:
    """The stage-1 loss of the items ``b`` (module docstring); ``threshold`` is the logistic loss's."""
    B = len(b)
    c = log_c.exp()
    m = cfg.encoder_margin
    k = F.normalize(cs.request[b] @ K.T, dim=-1)  # (B, p)
    q_pos = cs.paraphrase[b] @ Q.T
    q_loc = cs.locality[b] @ Q.T
    q_ss = cs.same_subject[b] @ Q.T  # (B, S, p)
    s_pp = c * q_pos @ k.T  # (B queries, B keys)
    s_pos = s_pp.diagonal()
    s_loc_all = c * q_loc @ k.T  # (B locality inputs, B keys)
    s_loc = s_loc_all.diagonal()
    s_ss = c * torch.einsum("bsp,bp->bs", q_ss, k)
    target = torch.arange(B)
    query_logits = s_pp
    margin_ss = s_ss
    if cfg.encoder_same_subject_keys:
        k_ss = F.normalize(cs.same_subject[b] @ K.T, dim=-1)  # (B, S, p): keys of the subject's other relations
        s_key_ss = c * torch.einsum("bp,bsp->bs", q_pos, k_ss)
        query_logits = torch.cat([s_pp, s_key_ss], dim=1)
        margin_ss = torch.cat([s_ss, s_key_ss], dim=1)
    rank_q = F.cross_entropy(query_logits, target)  # each paraphrase picks its own key
    if cfg.experimental.encoder_batch_negatives:  # every locality input and same-subject prompt of the batch
        key_negatives = [s_loc_all.T, c * torch.einsum("jsp,ip->ijs", q_ss, k).reshape(B, -1)]
    else:  # the key's own only
        key_negatives = [s_loc[:, None], s_ss]
    key_logits = torch.cat([s_pp.T, *key_negatives], dim=1)  # each key picks its own paraphrase
    rank_k = F.cross_entropy(key_logits, target)
    margin = (F.relu(m + s_loc - s_pos) ** 2).mean() + (F.relu(m + margin_ss - s_pos[:, None]) ** 2).mean()
    gram = k @ k.T
    ortho = ((gram - torch.eye(B)) ** 2).sum() / (B * (B - 1))
    loss = rank_q + rank_k + margin + cfg.encoder_ortho * ortho
    if cfg.experimental.encoder_threshold_weight:
        off_diagonal = ~torch.eye(B, dtype=torch.bool)
        negatives = torch.cat([s_pp[off_diagonal], s_loc_all.reshape(-1), margin_ss.reshape(-1)])
        loss = loss + cfg.experimental.encoder_threshold_weight * (
            F.softplus(threshold - s_pos).mean() + F.softplus(negatives - threshold).mean()
        )
    return loss


def dropped_batch(cs: CorpusStates, b: torch.Tensor, rate: float, gen: torch.Generator) -> CorpusStates:
    """The states of items ``b`` with a random ``rate`` of each state's coordinates zeroed, renormalized."""

    def drop(x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=gen) >= rate
        return F.normalize(x * keep, dim=-1)

    return CorpusStates(*(drop(getattr(cs, f.name)[b]) for f in dataclasses.fields(cs)))


MEMBER_SEED_STRIDE = 7919  # member j of an ensemble trains with seed + j * stride (member 0 with the seed itself)


def train_encoder(cs: CorpusStates, groups: list[str], idx: list[int], cfg: BuildConfig) -> AddressEncoder:
    """Fit Q, K, c on the items ``idx``: ``cfg.experimental.encoder_members`` members, each from its own seed."""
    n = cfg.experimental.encoder_members
    members = [
        _train_member(
            cs,
            groups,
            idx,
            dataclasses.replace(cfg, seed=cfg.seed + j * MEMBER_SEED_STRIDE),
            f"stage 1: address encoder {j + 1}/{n}" if n > 1 else "stage 1: address encoder",
        )
        for j in range(n)
    ]
    return AddressEncoder(*(torch.cat([getattr(m, f) for m in members]) for f in ("Q", "K", "log_c")))


def _train_member(cs: CorpusStates, groups: list[str], idx: list[int], cfg: BuildConfig, desc: str) -> AddressEncoder:
    """One member, seeded by ``cfg.seed``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    d = cs.request.shape[1]
    p = cfg.encoder_dim
    Q = (torch.randn(p, d, generator=gen) / d**0.5).requires_grad_(True)
    K = (torch.randn(p, d, generator=gen) / d**0.5).requires_grad_(True)
    log_c = torch.tensor(2.0, requires_grad=True)
    threshold = torch.tensor(0.0, requires_grad=True)  # of the logistic loss only; not part of the encoder
    opt = torch.optim.AdamW([Q, K, log_c, threshold], lr=cfg.encoder_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    sub_groups = [groups[i] for i in idx]
    batches = _balanced_batches(sub_groups, cfg.encoder_batch, rng)
    bar = tqdm(range(cfg.encoder_steps), desc=desc, leave=False)
    for _ in bar:
        b = torch.tensor([idx[j] for j in next(batches)])
        dropout = cfg.experimental.encoder_dropout
        states, rows = (dropped_batch(cs, b, dropout, gen), torch.arange(len(b))) if dropout else (cs, b)
        loss = batch_loss(states, rows, Q, K, log_c, threshold, cfg)
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


# the stage-1 fields that decide the corpus items (and so the shared negatives mined from them)
CORPUS_FIELDS = ("encoder_corpus", "encoder_records", "encoder_same_subject")


def cache_key(fingerprint: str, layer: int, corpus_path: Path, cfg: BuildConfig, corpus_only: bool = False) -> str:
    """Key of an encoder in the cache: model weight, layer, corpus and the stage-1 settings (not the
    cache's place); with ``corpus_only``, only what decides the corpus items (the shared negatives' key).
    The corpus counts by its content, not its path: a checkout elsewhere reuses the cache, and a file
    rewritten in place does not."""
    fields = {k: v for k, v in cfg.fields_of(1).items() if k != "encoder_cache" and (not corpus_only or k in CORPUS_FIELDS)}
    corpus = file_sha256(corpus_path)
    h = hashlib.sha256()
    h.update(json.dumps([fingerprint, layer, corpus, fields, cfg.seed, CORPUS_VERSION], sort_keys=True).encode())
    return h.hexdigest()[:16]
