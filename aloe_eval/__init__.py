"""Evaluation of knowledge editors: the paper's protocol, EasyEdit's numbers, gate diagnostics.

:func:`evaluate` scores an ALOE operator and baselines (the unedited model,
the unedited model told each fact first, :class:`ToldEditor`, a GRACE
reimplementation in :mod:`aloe_eval.baselines.grace`) on one model
and one edit stream; :class:`EvalReport` holds and writes the result.
"""

from .definitions import METRIC_DEFINITIONS
from .editors import AloeEditor, Editor, ToldEditor, UneditedEditor
from .metrics import exact_match, relative_drift, token_accuracy
from .protocol import evaluate
from .report import EditorResult, EvalReport

__all__ = [
    "AloeEditor",
    "Editor",
    "EditorResult",
    "EvalReport",
    "METRIC_DEFINITIONS",
    "ToldEditor",
    "UneditedEditor",
    "evaluate",
    "exact_match",
    "relative_drift",
    "token_accuracy",
]
