"""Inputs of the vLLM serving benchmark (``benchmarks/serving/bench_vllm.py``): prompts and operators.

- :data:`SAMPLE_EDITS`: twenty CounterFact records whose prompts calibrate
  (requests, rephrases) and check (unrelated prompts) the operators' gates;
- :func:`random_sparse_operator`: random addresses calibrated so that most
  tokens open no edit and some open one.
"""

from __future__ import annotations

import math

import torch

from aloe_kernels import AloeOperator
from aloe_kernels.operator import DEFAULT_GATE_EPS

__all__ = ["SAMPLE_EDITS", "random_sparse_operator"]

#: Twenty CounterFact records (validation split, Meng et al. 2022, MIT license):
#: (request prompt, new target, rephrase, unrelated "locality" prompt).
SAMPLE_EDITS = [
    ("BBC One, by", "Sega", "BBC One is my favorite product out of everything owned by", "BBC Radio, by"),
    ("The profession of Arun Nehru is", "actor", "Arun Nehru is known for", "George Washington's profession is a"),
    (
        "Howard Glacier is located in",
        "Europe",
        "A Marañón Week is annually held since 1990. Howard Glacier is in",
        "Antarctic Peninsula is located in the continent",
    ),
    (
        "Kuala Langat, located in",
        "India",
        "Kuala Langat's surroundings include",
        "Kuala Lumpur Sentral station is located in the country of",
    ),
    ("Galata is in", "Naples", "Galata's surroundings include", "Halıcıoğlu is within"),
    ("What does Frank Mantooth play? They play", "trance", "Frank Mantooth is incredible at", "Sade Adu plays"),
    ("Luana Walters's profession is an", "politician", "Luana Walters is known for", "Paul McCartney, who works as"),
    ("Valdemarsvik, which is located in", "Iran", "One can get to Valdemarsvik by navigating", "Lidingö, which is located in"),
    ("BMW 326, produced by", "Sony", "The production of BMW 326 is overseen by", "BMW M54, developed by"),
    (
        "Pinhas Hirschprung passed away in",
        "Paris",
        "When Pinhas Hirschprung was killed, the locals held a",
        "André Raynauld passed away at",
    ),
    ("The language of Dehkhoda Dictionary is", "Russian", "Dehkhoda Dictionary's author is from", "Hasht-Bihisht was written in"),
    (
        "Sam Cooke, that was created in",
        "Boston",
        "Sam Cooke originated from",
        "American Legislative Exchange Council, that was formed in",
    ),
    (
        "Sandy Bridge was a product of",
        "Apple",
        "Sandy Bridge is my favorite product out of everything created by",
        "Advanced Configuration and Power Interface Specification Version 5.0 is created by",
    ),
    ("Nizampatnam is located in the country of", "Ghana", "One can get to Nizampatnam by navigating", "Kurnool District, in"),
    (
        "Julien Courbet is a native speaker of",
        "Russian",
        "Where Julien Courbet is from, people speak the language of",
        "The native language of Octave Mirbeau is",
    ),
    (
        "What does Alberto Mazzucato play? They play",
        "jazz",
        "Alberto Mazzucato's greatest artistic work is",
        "Ignaz Brüll is known for performing",
    ),
    (
        "Business Development Bank of Canada originated in",
        "Oxford",
        "Business Development Bank of Canada originated from",
        "Chromeo that was founded in",
    ),
    (
        "Moscow is a twin city of",
        "Miami",
        "Moscow's twin city has famous tourist attractions including",
        "The twin city of Riga is",
    ),
    (
        "Al Madinah Region's capital is",
        "London",
        "Guillaume de Machaut. Al Madinah Region's capital city is",
        "Medina Province, which has the capital city",
    ),
    (
        "Antonio Franco holds the position of",
        "cardinal",
        "Antonio Franco works as a",
        "Lucifer of Cagliari, who holds the position of",
    ),
]


def random_sparse_operator(
    n: int,
    d: int,
    d_out: int,
    states: torch.Tensor | None = None,
    *,
    open_fraction: float = 0.05,
    temperature: float = 30.0,
    write_scale: float = 0.0,
    seed: int = 0,
    layer: int | None = None,
    weight_fingerprint: str | None = None,
) -> AloeOperator:
    """Random unit addresses with thresholds calibrated on ``states`` (T, d).

    Each edit's threshold is placed so that about ``open_fraction`` of tokens
    like ``states`` open *some* edit (most open none, some one); check the
    result on held-out states with ``aloe_gates``. Without ``states``
    thresholds are 0.5.
    ``write_scale=0`` gives zero writes (outputs unchanged, cost unchanged).
    """
    g = torch.Generator().manual_seed(seed)
    addresses = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    if states is not None and states.shape[0] > 1:
        s = torch.nn.functional.normalize(states.float(), dim=1) @ addresses.T  # (T, n)
        # A sample of a few hundred tokens cannot resolve per-edit open rates of
        # ~1e-5, so model each edit's score as Gaussian over tokens and put its
        # open floor at the (1 - open_fraction / n) quantile: about open_fraction
        # of tokens then open some edit, almost always exactly one.
        p = min(max(open_fraction / max(n, 1), 1e-12), 0.5)
        z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - p, dtype=torch.float64)))
        floor = s.mean(0) + z * s.std(0)
        # g > 0 iff s > tau + logit(gate_eps) / alpha: put that point at the floor.
        thresholds = floor - math.log(DEFAULT_GATE_EPS / (1 - DEFAULT_GATE_EPS)) / temperature
    else:
        thresholds = torch.full((n,), 0.5)
    writes = torch.randn(n, d_out, generator=g) * write_scale
    return AloeOperator(
        addresses=addresses,
        thresholds=thresholds.float(),
        temperatures=torch.full((n,), float(temperature)),
        writes=writes,
        layer=layer,
        weight_fingerprint=weight_fingerprint,
    )
