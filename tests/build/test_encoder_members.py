"""Several stage-1 encoders whose addresses are averaged (``encoder_members``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from build_helpers import random_corpus_states, unit
from safetensors.torch import save_file

from aloe_build.config import BuildConfig
from aloe_build.stages.s1_encoder import MEMBER_SEED_STRIDE, AddressEncoder, CorpusStates, train_encoder


def _states(seed: int, N: int = 21, S: int = 2, d: int = 13) -> CorpusStates:
    return random_corpus_states(torch.Generator().manual_seed(seed), N, S, d)


def _address_by_hand(Q: torch.Tensor, K: torch.Tensor, log_c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Float64 mean over members of c_e Q_e^T (K_e h / |K_e h|), one state at a time."""
    Q, K, c, h = Q.double(), K.double(), log_c.double().exp(), h.double()
    rows = []
    for x in h:
        total = torch.zeros(Q.shape[-1], dtype=torch.float64)
        for e in range(Q.shape[0]):
            k = K[e] @ x
            total += c[e] * (Q[e].T @ (k / k.norm()))
        rows.append(total / Q.shape[0])
    return torch.stack(rows)


@pytest.mark.parametrize("members", [0, -2])
def test_encoder_members_below_one_is_refused(members):
    with pytest.raises(ValueError, match="encoder_members"):
        BuildConfig(encoder_members=members)


def test_members_are_the_single_encoders_of_their_seeds_and_addresses_their_mean():
    cs = _states(3)
    N = cs.request.shape[0]
    groups = [f"r{i % 4}" for i in range(N)]
    cfg = BuildConfig(encoder_dim=5, encoder_steps=6, encoder_batch=8, seed=11, encoder_members=3)
    ens = train_encoder(cs, groups, list(range(N)), cfg)
    assert ens.members == 3 and ens.Q.shape == (3, 5, 13) and ens.log_c.shape == (3,)
    for j in range(3):
        one = train_encoder(
            cs, groups, list(range(N)), dataclasses.replace(cfg, encoder_members=1, seed=11 + j * MEMBER_SEED_STRIDE)
        )
        assert torch.equal(ens.Q[j], one.Q[0]) and torch.equal(ens.K[j], one.K[0])
        assert torch.equal(ens.log_c[j], one.log_c[0])
    # distinct seeds give distinct members
    assert not torch.allclose(ens.Q[0], ens.Q[1])
    h = _states(4, N=7).paraphrase
    torch.testing.assert_close(ens.addresses(h).double(), _address_by_hand(ens.Q, ens.K, ens.log_c, h), rtol=1e-5, atol=1e-6)
    assert ens.c == pytest.approx(float(ens.log_c.exp().mean()))


def test_one_member_keeps_the_single_encoder():
    cs = _states(5)
    N = cs.request.shape[0]
    groups = [f"r{i % 3}" for i in range(N)]
    enc = train_encoder(cs, groups, list(range(N)), BuildConfig(encoder_dim=4, encoder_steps=4, encoder_batch=8))
    assert enc.members == 1
    h = _states(6, N=1).request  # T = 1
    Q, K, c = enc.Q[0].double(), enc.K[0].double(), float(enc.log_c[0].exp())
    k = K @ h[0].double()
    torch.testing.assert_close(enc.addresses(h)[0].double(), c * (Q.T @ (k / k.norm())), rtol=1e-5, atol=1e-6)


def test_save_and_load_keep_every_member_and_read_a_single_encoder_file(tmp_path):
    g = torch.Generator().manual_seed(9)
    Q, K, log_c = torch.randn(2, 3, 10, generator=g), torch.randn(2, 3, 10, generator=g), torch.randn(2, generator=g)
    AddressEncoder(Q, K, log_c).save(tmp_path / "two", {"note": 1})
    back, metrics = AddressEncoder.load(tmp_path / "two")
    assert metrics == {"note": 1} and back.members == 2
    assert torch.equal(back.Q, Q) and torch.equal(back.K, K) and torch.equal(back.log_c, log_c)
    # a file of one member as (p, d) and a (1,) scale, as cached before members existed
    (tmp_path / "one").mkdir()
    save_file(
        {"Q": Q[0].contiguous(), "K": K[0].contiguous(), "log_c": log_c[:1].contiguous()},
        str(tmp_path / "one" / "encoder.safetensors"),
    )
    (tmp_path / "one" / "encoder.json").write_text("{}")
    one, _ = AddressEncoder.load(tmp_path / "one")
    h = unit(torch.randn(4, 10, generator=g))
    torch.testing.assert_close(one.addresses(h).double(), _address_by_hand(Q[:1], K[:1], log_c[:1], h), rtol=1e-5, atol=1e-6)
