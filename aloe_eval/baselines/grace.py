"""GRACE (Hartvigsen et al., 2023), reimplemented on the layer ALOE edits, for same-work comparisons.

Named "GRACE (reimplementation)" in reports. It follows EasyEdit's GRACE
(``easyeditor/models/grace/GRACE.py``, hparams ``hparams/GRACE/llama-7B.yaml``)
where that transfers, and says where it does not:

* **Where.** A module wrapper around the same MLP down-projection ALOE
  edits (EasyEdit's GRACE also wraps ``mlp.down_proj``; its published Llama
  config uses layer 31 of 32, here the layer is whatever ALOE uses).
* **Keys.** The down-projection input ``h`` at the last prompt token of the
  request (EasyEdit: the token before the first label token). Keys depend
  only on the layers below, which no edit changes, so all keys come from one
  batched pass of the unedited model.
* **Codebook.** Edits are inserted in stream order with GRACE's rules:
  Euclidean distance; a key farther than ``eps_init + eps[nearest]`` from
  every key opens a new entry with radius ``eps_init``; within reach and the
  same target (GRACE compares labels), the nearest radius grows to cover
  the new key (``eps_expand="coverage"``) and the edit shares that entry;
  within reach and a different target, a new entry is added and both radii
  become half the distance (``split_epsilons_in_half``).
* **Radius.** ``eps_init = 1.0`` in the units of ``h`` (EasyEdit's published
  value, absolute, not relative). For scale: on SmolLM2-135M-Instruct layer 14
  the median key norm is about 6.9 and the median distance to the nearest
  other CounterFact key about 5.8, so the radius is about 0.15 of a key's
  norm; a rephrase's state is typically ~8.8 away from its request's key and
  so never hits (GRACE's published near-zero generalization). The fitted
  editor reports these statistics in its ``info()``.
* **Values.** On a hit the down-projection *output* at that token is replaced
  by the entry's value vector (``replace_last`` semantics: each token is
  looked up on its own, so under incremental decoding the current token is
  the last one; in a teacher-forced pass every position is looked up
  causally, which gives the same outputs). Values start "cold" (uniform
  [0, 1), as EasyEdit's ``val_init: cold``) and are trained with Adam at
  ``lr = 1.0`` (EasyEdit ``edit_lr``) for up to ``n_iter = 100`` steps on the
  teacher-forced NLL of the target tokens of ``prompt + " " + target``, with
  the value forced in at the key token. Deviation, for CPU budgets: edits
  are trained in batches (each value only affects its own sequence; entries
  shared by several edits are trained on all of them), the prompt prefix
  before the key token is computed once and reused from a KV cache (it
  cannot depend on the value), and a batch stops early once every target
  token is predicted and every sequence's mean NLL is below
  ``early_stop_nll`` (0.05): per edit, an entry is frozen at the step where
  all its edits first meet that (Adam keeps moving a converged value by about
  ``lr`` per coordinate and step, which at ``lr = 1.0`` undoes the fit), and
  the batch stops when every entry is frozen or after ``n_iter`` steps.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from aloe_build.checkpoints import run_key
from aloe_build.forward import batches, model_device, progress_bar
from aloe_build.tokens import encode_continuation, left_pad
from aloe_build.tokens import pad_id as tokenizer_pad_id
from aloe_kernels import weight_fingerprint
from aloe_kernels.hf import locate_down_proj

from ..content_key import content_key
from ..editors import Editor

__all__ = ["GraceConfig", "GraceDownProj", "GraceEditor", "fit_grace"]

NAME = "GRACE (reimplementation)"
#: Bump when what a batch of value training computes changes (it keys the saved fits).
FIT_FORMAT = 1
#: Directory under ALOE's cache root where ``aloe eval --baseline grace`` saves its fits as they go.
GRACE_CACHE = "grace"


@dataclasses.dataclass
class GraceConfig:
    """GRACE hyperparameters (defaults: EasyEdit's published GRACE config, see the module docstring)."""

    eps: float = 1.0
    n_iter: int = 100
    lr: float = 1.0
    value_init: str = "cold"  # "cold": U[0, 1); "warm": the layer's own output at the key token
    eps_expand: str = "coverage"
    early_stop_nll: float = 0.05
    seed: int = 0


class GraceDownProj(nn.Module):
    """``y = base(h)``, except where ``h`` is within an entry's radius of its key: there ``y = value``.

    ``force`` (training only): ``(slots, positions)`` replaces the output at
    ``positions[b]`` of row b by the value of ``slots[b]`` regardless of distance.
    """

    def __init__(self, base: nn.Module, keys: torch.Tensor, eps: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.base = base
        self.register_buffer("keys", keys.float(), persistent=False)
        self.register_buffer("eps", eps.float(), persistent=False)
        self.values = values  # (m, d_out); a plain tensor, or one with a grad path during training
        self.force: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # lookup of the latest input

    def lookup(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit, slot)`` for every token of ``h`` (..., d): nearest key and whether it is within its radius."""
        last = self._last
        if last is not None and last[0] is h:
            return last[1], last[2]
        flat = h.detach().reshape(-1, h.shape[-1]).double()
        if self.keys.shape[0] == 0:
            z = torch.zeros(flat.shape[0], dtype=torch.bool, device=h.device)
            return z.reshape(h.shape[:-1]), torch.zeros_like(z, dtype=torch.long).reshape(h.shape[:-1])
        # squared Euclidean distances through one float64 matmul (accurate to ~1e-6 at distance 0)
        keys = self.keys.double()
        d2 = (flat * flat).sum(1, keepdim=True) + (keys * keys).sum(1)[None] - 2.0 * (flat @ keys.T)
        dmin2, idx = d2.min(dim=1)
        eps = self.eps.double()[idx]
        hit = dmin2.clamp_min(0) <= eps * eps
        out = hit.reshape(h.shape[:-1]), idx.reshape(h.shape[:-1])
        self._last = (h, out[0], out[1])
        return out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.base(h)
        hit, idx = self.lookup(h)
        if self.force is not None:
            slots, pos = self.force
            rows = torch.arange(h.shape[0], device=h.device)
            hit = hit.clone()
            idx = idx.clone()
            hit[rows, pos] = True
            idx[rows, pos] = slots.to(idx.device)
        if not bool(hit.any()):
            return y
        vals = self.values[idx].to(y.dtype)
        return torch.where(hit[..., None], vals, y)


class GraceEditor(Editor):
    """A fitted GRACE codebook for one layer; attach/detach patch the down-projection."""

    def __init__(
        self,
        layer: int,
        keys: torch.Tensor,
        eps: torch.Tensor,
        values: torch.Tensor,
        edit_slots: list[int],
        edit_ids: list[str],
        labels: list[str],
        info: dict[str, Any],
        name: str = NAME,
    ):
        self.name = name
        self.layer = layer
        self.keys, self.eps, self.values = keys, eps, values
        self.slot_per_edit = edit_slots  # the Editor method edit_slots answers per request
        self._by_id = {i: s for i, s in zip(edit_ids, edit_slots)}
        self.labels = labels
        self._info = info
        self._wrapper: GraceDownProj | None = None

    @property
    def n_slots(self) -> int:
        return int(self.keys.shape[0])

    def attach(self, model: nn.Module) -> None:
        site = locate_down_proj(model, self.layer)
        if isinstance(site.module, GraceDownProj):
            raise RuntimeError(f"{site.path} already carries a GRACE codebook")
        dev = site.weight().device
        w = GraceDownProj(site.module, self.keys.to(dev), self.eps.to(dev), self.values.to(dev))
        setattr(site.parent, site.attr, w)
        self._wrapper = w

    def detach(self, model: nn.Module) -> None:
        for name, m in list(model.named_modules()):
            if isinstance(m, GraceDownProj):
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, m.base)
        self._wrapper = None

    @property
    def has_slots(self) -> bool:
        return True

    def slot_activations(self, h: torch.Tensor) -> torch.Tensor:
        w = self._wrapper  # reuses the lookup the patched module just did on this very input
        if w is None:
            w = GraceDownProj(nn.Identity(), self.keys.to(h.device), self.eps.to(h.device), self.values)
        hit, idx = w.lookup(h)
        out = torch.zeros(*h.shape[:-1], self.n_slots, device=h.device)
        out.scatter_(-1, idx[..., None], hit[..., None].float())
        return out

    def slot_of(self, request: Any, index: int) -> int | None:
        rid = getattr(request, "id", None)
        key = str(rid) if rid is not None else f"edit-{index}"
        return self._by_id.get(key)

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def state_key(self) -> str:
        # the patched layer answers from its keys, radii and values alone
        return content_key([NAME, self.layer, *(weight_fingerprint(t) for t in (self.keys, self.eps, self.values))])


def _down_proj_inputs(
    model, tokenizer, prompts_ids: list[tuple[int, ...]], layer: int, batch_size: int, progress: bool
) -> torch.Tensor:
    site = locate_down_proj(model, layer)
    pad_id = tokenizer_pad_id(tokenizer)
    device = model_device(model)
    out = torch.zeros(len(prompts_ids), site.d)
    seen: dict[str, torch.Tensor] = {}
    hook = site.module.register_forward_hook(lambda m, a, o: seen.__setitem__("h", a[0].detach()))
    order = sorted(range(len(prompts_ids)), key=lambda i: len(prompts_ids[i]))
    bar = progress_bar(len(order), "GRACE: keys", progress)
    try:
        with torch.inference_mode():
            for batch in batches(order, batch_size):
                ids, mask, pos = left_pad([prompts_ids[i] for i in batch], pad_id, device)
                model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
                out[batch] = seen["h"][:, -1].float().cpu()
                bar.update(len(batch))
    finally:
        hook.remove()
        bar.close()
    return out


def _codebook(keys: torch.Tensor, labels: list[str], cfg: GraceConfig):
    """GRACE's sequential insertion rules; returns (entry keys, radii, slot of each edit, entry labels)."""
    entries: list[torch.Tensor] = []
    eps: list[float] = []
    ent_labels: list[str] = []
    slots: list[int] = []
    stats = {"new": 0, "expanded": 0, "shared": 0, "conflict_splits": 0}
    K = torch.zeros(0, keys.shape[1])
    for q, lab in zip(keys, labels):
        if not entries:
            entries.append(q)
            eps.append(cfg.eps)
            ent_labels.append(lab)
            slots.append(0)
            K = q[None].clone()
            stats["new"] += 1
            continue
        d = (K - q).norm(dim=1)
        j = int(d.argmin())
        dj = float(d[j])
        if dj > cfg.eps + eps[j]:
            entries.append(q)
            eps.append(cfg.eps)
            ent_labels.append(lab)
            slots.append(len(entries) - 1)
            K = torch.cat([K, q[None]])
            stats["new"] += 1
        elif ent_labels[j] == lab:
            slots.append(j)
            stats["shared"] += 1
            if dj > eps[j]:
                if cfg.eps_expand == "coverage":
                    eps[j] = dj
                elif cfg.eps_expand == "moving_average":
                    K[j] = 0.5 * K[j] + 0.5 * q
                    eps[j] = dj
                stats["expanded"] += 1
        else:
            entries.append(q)
            ent_labels.append(lab)
            K = torch.cat([K, q[None]])
            eps[j] = dj / 2 - 1e-5
            eps.append(dj / 2)
            slots.append(len(entries) - 1)
            stats["new"] += 1
            stats["conflict_splits"] += 1
    return K, torch.tensor(eps, dtype=torch.float32), slots, ent_labels, stats


def fit_grace(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    layer: int,
    config: GraceConfig | None = None,
    *,
    batch_size: int = 16,
    progress: bool = True,
    checkpoint_dir: Path | None = None,
) -> GraceEditor:
    """Fit a GRACE codebook for ``requests`` at ``layer`` of ``model`` (left unpatched on return).

    With ``checkpoint_dir`` the values are saved there after each batch of edits, under a key of the
    model's weight, the layer, the requests, ``config`` and ``batch_size``: an interrupted fit resumes
    at the first batch not yet trained, and a finished one is read back instead of trained again
    (the info's ``resumed_batches`` says how many batches were read)."""
    cfg = config or GraceConfig()
    t0 = time.perf_counter()
    site = locate_down_proj(model, layer)
    enc = [encode_continuation(tokenizer, r.prompt, r.target_new) for r in requests]
    labels = [r.target_new.strip() for r in requests]
    ids = [str(r.id) if r.id is not None else f"edit-{i}" for i, r in enumerate(requests)]
    keys = _down_proj_inputs(model, tokenizer, [p for p, _ in enc], layer, batch_size, progress)
    K, eps, slots, ent_labels, stats = _codebook(keys, labels, cfg)
    m = K.shape[0]
    device = model_device(model)
    values = _initial_values(site, K, cfg, device)

    # --- train the values, a batch of edits at a time -------------------------------------------
    saves = _FitCheckpoint(checkpoint_dir, site.weight(), requests, layer, cfg, batch_size)
    wrapper = GraceDownProj(site.module, K.to(device), eps.to(device), values)
    setattr(site.parent, site.attr, wrapper)
    pad_id = tokenizer_pad_id(tokenizer)
    iters_used: list[int] = []
    final_nll: list[float] = []
    order = list(range(len(requests)))
    resumed = saves.restore(wrapper.values, iters_used, final_nll)
    bar = progress_bar(len(order), "GRACE: values", progress)
    try:
        for k, batch in enumerate(batches(order, batch_size)):
            if k >= resumed:
                it, nll = _train_batch(model, wrapper, [enc[i] for i in batch], [slots[i] for i in batch], cfg, pad_id, device)
                iters_used.append(it)
                final_nll.extend(nll)
                saves.save(wrapper.values, iters_used, final_nll)
            bar.update(len(batch))
    finally:
        bar.close()
        setattr(site.parent, site.attr, wrapper.base)
    values = wrapper.values.detach().cpu()
    nn_dist = None
    if m > 1:
        d = torch.cdist(K, K)
        d.fill_diagonal_(float("inf"))
        nn_dist = float(d.min(dim=1).values.median())
    info = {
        "kind": "grace",
        "reimplementation_of": "GRACE (Hartvigsen et al., 2023) as in EasyEdit's easyeditor/models/grace",
        "layer": layer,
        "module_path": site.path,
        "config": dataclasses.asdict(cfg),
        "n_entries": m,
        "codebook": stats,
        "eps": {"min": float(eps.min()), "median": float(eps.median()), "max": float(eps.max())},
        "key_norm_median": float(K.norm(dim=1).median()),
        "nearest_key_distance_median": nn_dist,
        "train_iters": {
            "batches": len(iters_used),
            "mean": sum(iters_used) / max(1, len(iters_used)),
            "max": max(iters_used) if iters_used else 0,
        },
        "train_final_nll": {"mean": sum(final_nll) / max(1, len(final_nll)), "max": max(final_nll, default=0.0)},
        "fit_s": time.perf_counter() - t0,
        "resumed_batches": resumed,
    }
    return GraceEditor(layer, K, eps, values, slots, ids, ent_labels, info)


class _FitCheckpoint:
    """The values after each trained batch and the training record so far, in one safetensors file
    of ``root`` named by what the fit depends on (``root`` None: nothing is saved or read)."""

    def __init__(
        self, root: Path | None, weight: torch.Tensor, requests: Sequence[Any], layer: int, cfg: GraceConfig, batch_size: int
    ):
        key = content_key([run_key(requests, weight_fingerprint(weight), layer), FIT_FORMAT, batch_size, dataclasses.asdict(cfg)])
        self.file = None if root is None else Path(root) / f"grace-layer{layer}-{key}.safetensors"

    def restore(self, values: torch.Tensor, iters_used: list[int], final_nll: list[float]) -> int:
        """Load the saved values into ``values`` and the record into the lists; the batches done."""
        from aloe_build.checkpoints import load_tensors

        saved = load_tensors(self.file)
        if saved is None:
            return 0
        tensors, meta = saved
        values.data.copy_(tensors["values"])
        iters_used.extend(json.loads(meta["iters"]))
        final_nll.extend(json.loads(meta["nll"]))
        return len(iters_used)

    def save(self, values: torch.Tensor, iters_used: list[int], final_nll: list[float]) -> None:
        if self.file is None:
            return
        from aloe_build.checkpoints import save_tensors_atomically

        meta = {"iters": json.dumps(iters_used), "nll": json.dumps(final_nll)}
        save_tensors_atomically({"values": values.detach().cpu().contiguous()}, self.file, metadata=meta)


def _initial_values(site, K: torch.Tensor, cfg: GraceConfig, device) -> torch.Tensor:
    """The entries' values before training: "cold" (uniform [0, 1), seeded) or "warm" (the layer's output at each key)."""
    if cfg.value_init == "cold":
        values = torch.rand(K.shape[0], site.d_out, generator=torch.Generator().manual_seed(cfg.seed))
    elif cfg.value_init == "warm":
        with torch.no_grad():
            values = site.module(K.to(device, site.weight().dtype)).float().cpu()
    else:
        raise ValueError(f"value_init must be 'cold' or 'warm', got {cfg.value_init!r}")
    return values.to(device)


def _layout(enc, pad_id: int, device, model):
    """Inputs for value training: ``(ids, mask, pos, labels, key_pos, cache)``.

    When every prompt has at least two tokens, the prompt prefix before the
    key token is run once (no gradient; it cannot depend on the value) and
    kept as a KV cache; the trained part is then the key token plus the
    target tokens, right-padded, with every key token at column 0. Otherwise
    the full left-padded sequences are used. ``labels[b, t]`` is the token
    position t must predict (-100 where nothing is scored).
    """
    B = len(enc)
    if all(len(p) >= 2 for p, _ in enc):
        prefix = [list(p[:-1]) for p, _ in enc]
        suffix = [[p[-1]] + list(c) for p, c in enc]
        S = max(len(x) for x in suffix)
        pre_ids, pre_mask, pre_pos = left_pad(prefix, pad_id, device)
        with torch.no_grad():
            cache = model(
                input_ids=pre_ids, attention_mask=pre_mask, position_ids=pre_pos, use_cache=True, logits_to_keep=1
            ).past_key_values
        ids = torch.full((B, S), pad_id, dtype=torch.long)
        smask = torch.zeros((B, S), dtype=torch.long)
        labels = torch.full((B, S), -100, dtype=torch.long)
        for b, (x, (_, c)) in enumerate(zip(suffix, enc)):
            ids[b, : len(x)] = torch.tensor(x)
            smask[b, : len(x)] = 1
            labels[b, : len(c)] = torch.tensor(c)
        ids, smask, labels = ids.to(device), smask.to(device), labels.to(device)
        pos = pre_mask.sum(1, keepdim=True) + torch.arange(S, device=device)[None]
        mask = torch.cat([pre_mask, smask], dim=1)
        key_pos = torch.zeros(B, dtype=torch.long, device=device)
        return ids, mask, pos, labels, key_pos, cache
    full = [list(p) + list(c) for p, c in enc]
    ids, mask, pos = left_pad(full, pad_id, device)
    T = ids.shape[1]
    labels = torch.full((B, T), -100, dtype=torch.long, device=device)
    key_pos = torch.zeros(B, dtype=torch.long, device=device)
    for b, (_, c) in enumerate(enc):
        k = len(c)
        key_pos[b] = T - 1 - k
        labels[b, T - 1 - k : T - 1] = torch.tensor(c, device=device)
    return ids, mask, pos, labels, key_pos, None


def _train_batch(model, wrapper: GraceDownProj, enc, slots, cfg: GraceConfig, pad_id: int, device) -> tuple[int, list[float]]:
    """Train the values of one batch of edits (entries shared within the batch are trained jointly)."""
    B = len(enc)
    ids, mask, pos, labels, key_pos, cache = _layout(enc, pad_id, device, model)
    slot_t = torch.tensor(slots, dtype=torch.long, device=device)
    uniq, inv = torch.unique(slot_t, return_inverse=True)
    all_values = wrapper.values.detach()
    param = nn.Parameter(all_values[uniq].clone())
    opt = torch.optim.Adam([param], lr=cfg.lr)
    valid = labels != -100
    it = 0
    nll_rows = torch.zeros(B)
    frozen = torch.zeros(len(uniq), dtype=torch.bool, device=device)  # entries whose edits are all fitted
    snapshot = param.detach().clone()
    try:
        for it in range(1, cfg.n_iter + 1):
            wrapper.values = all_values.index_copy(0, uniq, param)
            wrapper.force = (slot_t, key_pos)  # global entry indices
            past = copy.deepcopy(cache) if cache is not None else None
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=past is not None)
            logp = torch.log_softmax(out.logits.float(), dim=-1)
            tok_nll = -logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0] * valid
            nll = tok_nll.sum(1) / valid.sum(1).clamp_min(1)
            nll_rows = nll.detach().cpu()
            # early stop per edit: every target token predicted and mean NLL below the threshold; an
            # entry is frozen (its value kept as it is now) once all the edits sharing it are done
            done_row = ((logp.argmax(-1) == labels) | ~valid).all(1) & (nll.detach() < cfg.early_stop_nll)
            pending = torch.zeros(len(uniq), dtype=torch.long, device=device).index_add_(0, inv, (~done_row).long())
            newly = (pending == 0) & ~frozen
            if bool(newly.any()):
                snapshot[newly] = param.detach()[newly]
                frozen |= newly
            if bool(frozen.all()):
                break
            loss = (tok_nll.sum(1) / valid.sum(1).clamp_min(1))[~done_row].sum() / B
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                param[frozen] = snapshot[frozen]
    finally:
        wrapper.force = None
        wrapper.values = all_values.index_copy(0, uniq, param.detach())
    return it, [float(x) if math.isfinite(float(x)) else float("inf") for x in nll_rows]
