"""Metric primitives of the evaluation and the statistics of its summaries."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch


def exact_match(generated: str, answer: str) -> bool:
    """Exact match of a decoded generation to an answer: equal after ``strip()``."""
    return generated.strip() == answer.strip()


def contains_target(answer: str, target: str) -> bool:
    """Whether the answer mentions the target anywhere (case-insensitive)."""
    return target.strip().lower() in answer.lower()


def starts_with_target(answer: str, target: str) -> bool:
    """Whether the answer begins with the target (case-insensitive, surrounding spaces ignored)."""
    return answer.strip().lower().startswith(target.strip().lower())


def token_accuracy(predicted: Sequence[int], labels: Sequence[int]) -> float:
    """Share of positions where ``predicted`` equals ``labels`` (EasyEdit's ``np.mean(np.equal(...))``)."""
    if len(predicted) != len(labels):
        raise ValueError(f"length mismatch: {len(predicted)} predictions, {len(labels)} labels")
    if not labels:
        return float("nan")
    return sum(int(a == b) for a, b in zip(predicted, labels)) / len(labels)


def relative_drift(edited: torch.Tensor, reference: torch.Tensor) -> float:
    """``|edited - reference| / |reference|`` (L2)."""
    ref = reference.double()
    return float((edited.double() - ref).norm() / ref.norm().clamp_min(1e-12))


def mean(xs: Iterable[float | None]) -> float | None:
    """Mean of the values that are not None or NaN; None when there are none."""
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else None


def dist(xs: Sequence[float]) -> dict[str, Any] | None:
    """Count, mean, median, 10th/90th percentiles, min and max of ``xs`` (None when empty)."""
    v = sorted(float(x) for x in xs)
    if not v:
        return None

    def q(p: float) -> float:
        return v[min(len(v) - 1, max(0, int(round(p * (len(v) - 1)))))]

    return {"n": len(v), "mean": sum(v) / len(v), "median": q(0.5), "p10": q(0.1), "p90": q(0.9), "min": v[0], "max": v[-1]}


def mean_with_se(xs: Iterable[float | None]) -> dict[str, float] | None:
    """Mean of the values that are not None, its standard error (sample standard deviation over
    sqrt(n)) and n; None when there are none."""
    v = [float(x) for x in xs if x is not None]
    if not v:
        return None
    m = sum(v) / len(v)
    var = sum((x - m) ** 2 for x in v) / max(len(v) - 1, 1)
    return {"mean": m, "se": math.sqrt(var / len(v)), "n": len(v)}


def share(xs: Sequence[bool]) -> float | None:
    """Share of true values (None when empty)."""
    return sum(1 for x in xs if x) / len(xs) if xs else None


# =============================================================================
