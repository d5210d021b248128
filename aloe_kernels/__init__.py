"""ALOE runtime: the operator artifact, the reference math, the fused kernel
dispatch and the drop-in Hugging Face patch."""

from .errors import AloeError, ArtifactError, PatchError
from .hf import apply_aloe, remove_aloe, written_from
from .operator import AloeOperator, weight_fingerprint
from .reference import aloe_gates, aloe_reference
from .residual import aloe_residual_

__all__ = [
    "AloeError",
    "AloeOperator",
    "ArtifactError",
    "PatchError",
    "aloe_gates",
    "aloe_reference",
    "aloe_residual_",
    "apply_aloe",
    "remove_aloe",
    "weight_fingerprint",
    "written_from",
]
__version__ = "0.1.0"
