"""Shared inputs of the build (stage 1) tests."""

from __future__ import annotations

import torch

from aloe_build.stages.s1_encoder import CorpusStates


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` scaled to unit norm."""
    return x / x.norm(dim=-1, keepdim=True)


def random_corpus_states(g: torch.Generator, N: int, S: int, d: int, dtype=torch.float32) -> CorpusStates:
    """Unit random stage-1 states of N items with S same-subject prompts each."""
    return CorpusStates(*(unit(torch.randn(*shape, generator=g, dtype=dtype)) for shape in ((N, d), (N, d), (N, d), (N, S, d))))
