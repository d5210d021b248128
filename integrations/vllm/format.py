"""The on-disk contract between ``aloe export-vllm`` and the vLLM model classes.

An exported serving directory is the base model's Hugging Face directory
(weights and tokenizer files symlinked, not copied) with

- ``config.json`` rewritten: ``architectures`` set to the ALOE architecture
  (``LlamaForCausalLM`` -> ``AloeLlamaForCausalLM``, ...) and an ``aloe``
  section (see :class:`AloeSpec`);
- ``aloe_operator.safetensors``: the operator tensors under vLLM parameter names
  ``model.layers.{L}.mlp.down_proj.aloe_{addresses,thresholds,temperatures,writes}``,
  read by vLLM's own weight loader like any other checkpoint tensor;
- ``aloe_edits.json``: the operator's per-edit metadata (ids, requests), for people;
- ``capacity`` in the ``aloe`` section (optional): the number of edit slots the
  layer reserves (``n`` <= ``capacity``); slots past ``n`` are inert
  (:data:`INERT`), so a live swap of an operator with up to ``capacity`` edits
  changes no tensor's shape;
- ``model.safetensors.index.json`` rewritten (only when the base has one) so
  that vLLM's index filter keeps the operator file.

Nothing here imports vLLM or transformers: ``aloe_vllm.export`` writes
the format and ``aloe_vllm.models`` reads it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from aloe_kernels.errors import AloeError
from aloe_kernels.reading import check_decay
from aloe_kernels.write_positions import DEFAULT_WRITE_POSITIONS, check_write_positions

SPEC_VERSION = 1
CONFIG_KEY = "aloe"
TENSORS_FILE = "aloe_operator.safetensors"
EDITS_FILE = "aloe_edits.json"
SAFE_INDEX = "model.safetensors.index.json"
#: Suffixes of the operator parameters on the edited down-projection.
#: The environment variables of the live-swap endpoint (``aloe_vllm.admin``): its bearer key,
#: and the directory under which it reads operators.
ADMIN_KEY_ENV = "ALOE_ADMIN_KEY"
ADMIN_ROOT_ENV = "ALOE_ADMIN_ROOT"
#: The shortest admin key accepted.
ADMIN_KEY_MIN_CHARS = 16


def check_admin_key(key: str) -> None:
    """AloeSpecError unless ``key`` is long enough to stand as the live-swap endpoint's bearer key."""
    if len(key) < ADMIN_KEY_MIN_CHARS:
        raise AloeSpecError(f"{ADMIN_KEY_ENV}: the admin key needs at least {ADMIN_KEY_MIN_CHARS} characters, got {len(key)}")


PARAM_NAMES = ("aloe_addresses", "aloe_thresholds", "aloe_temperatures", "aloe_writes")
#: Base architecture -> ALOE architecture registered with vLLM.
ARCHITECTURES = {
    "LlamaForCausalLM": "AloeLlamaForCausalLM",
    "MistralForCausalLM": "AloeMistralForCausalLM",
    "Qwen2ForCausalLM": "AloeQwen2ForCausalLM",
    "Qwen3ForCausalLM": "AloeQwen3ForCausalLM",
}
BASE_ARCHITECTURES = {v: k for k, v in ARCHITECTURES.items()}
#: Values of an inert (unused) slot per operator field. A zero address scores exactly 0 for every h,
#: so the gate is sigmoid(1000 * (0 - 2)) = sigmoid(-2000), which is exactly 0.0 in float32 and
#: float64 (exp(-2000) underflows) whatever gate_eps is; the open floor (2 + logit(gate_eps)/1000 > 1.9)
#: is above any normalized score, so no screen keeps the slot; and the write is zero besides.
INERT = {"addresses": 0.0, "thresholds": 2.0, "temperatures": 1000.0, "writes": 0.0}


class AloeSpecError(AloeError, ValueError):
    """A serving directory (or operator) that cannot be served with this base model."""


class AloeSwapFailed(AloeError, RuntimeError):
    """A live swap whose writes failed; the message says whether the previous operator is live again."""


def down_proj_prefix(layer: int) -> str:
    """vLLM/HF module path of the edited down-projection."""
    return f"model.layers.{int(layer)}.mlp.down_proj"


def tensor_names(layer: int) -> dict[str, str]:
    """Checkpoint names of the operator tensors: field -> name."""
    prefix = down_proj_prefix(layer)
    return {p.removeprefix("aloe_"): f"{prefix}.{p}" for p in PARAM_NAMES}


def edit_share(n: int, rank: int, world: int) -> tuple[int, int]:
    """The edits rank ``rank`` of ``world`` adds the writes of: ``[lo, hi)``.

    ``[r*n//world, (r+1)*n//world)``: disjoint, covering, sizes differ by at most one.
    """
    return rank * n // world, (rank + 1) * n // world


def slot_order(slots: int, world: int) -> list[int]:
    """The slot each edit of an operator occupies, in edit order: the ranks' shares interleaved.

    Edit i goes to rank ``i % world`` while every share has room (uneven shares fill in turn), so
    any first n edits are spread over the ranks' writes instead of all landing in rank 0's share.
    One rank: the identity.
    """
    shares = [edit_share(slots, r, world) for r in range(world)]
    width = max((hi - lo for lo, hi in shares), default=0)
    return [lo + p for p in range(width) for lo, hi in shares if lo + p < hi]


@dataclasses.dataclass(frozen=True)
class AloeSpec:
    """The ``aloe`` section of an exported ``config.json``."""

    layer: int
    n: int
    d: int
    d_out: int
    eps: float
    gate_eps: float
    dtype: str = "float32"
    weight_fingerprint: str | None = None
    base_model: str | None = None
    base_architecture: str | None = None
    operator_fingerprint: str | None = None
    tensors_file: str = TENSORS_FILE
    version: int = SPEC_VERSION
    capacity: int | None = None
    write_positions: str = DEFAULT_WRITE_POSITIONS
    #: > 0: the gates read the running mean of the states (:mod:`aloe_vllm.reading`)
    reading_decay: float = 0.0

    @property
    def slots(self) -> int:
        """Edit slots the layer reserves: ``capacity``, or ``n`` when none is set."""
        return self.n if self.capacity is None else self.capacity

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.capacity is None:
            del out["capacity"]  # directories without live edits keep their former config
        if not self.reading_decay:
            del out["reading_decay"]  # last-token operators keep their former config
        return out

    @classmethod
    def from_config(cls, config: Any, source: str = "config.json") -> "AloeSpec":
        """Parse and check the ``aloe`` section of a (HF config object or dict) config."""
        raw = config.get(CONFIG_KEY) if isinstance(config, Mapping) else getattr(config, CONFIG_KEY, None)
        if raw is None:
            raise AloeSpecError(f"{source}: no '{CONFIG_KEY}' section; this directory was not written by `aloe export-vllm`")
        if not isinstance(raw, Mapping):
            raise AloeSpecError(f"{source}: '{CONFIG_KEY}' must be a JSON object, got {type(raw).__name__}")
        if raw.get("version") != SPEC_VERSION:
            raise AloeSpecError(f"{source}: {CONFIG_KEY}.version: expected {SPEC_VERSION}, got {raw.get('version')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - fields
        if unknown:
            raise AloeSpecError(f"{source}: {CONFIG_KEY}: unknown keys {sorted(unknown)}")
        for key in ("layer", "n", "d", "d_out", "eps", "gate_eps"):
            if key not in raw:
                raise AloeSpecError(f"{source}: {CONFIG_KEY}.{key} is missing")
        for key, low in (("layer", 0), ("n", 0), ("d", 1), ("d_out", 1)):
            v = raw[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise AloeSpecError(f"{source}: {CONFIG_KEY}.{key}: expected an int >= {low}, got {v!r}")
        cap = raw.get("capacity")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < raw["n"]):
            raise AloeSpecError(f"{source}: {CONFIG_KEY}.capacity: expected an int >= n={raw['n']} (edit slots), got {cap!r}")
        eps, geps = raw["eps"], raw["gate_eps"]
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise AloeSpecError(f"{source}: {CONFIG_KEY}.eps: expected a finite float > 0, got {eps!r}")
        if not (isinstance(geps, (int, float)) and 0 <= geps < 1):
            raise AloeSpecError(f"{source}: {CONFIG_KEY}.gate_eps: expected a float in [0, 1), got {geps!r}")
        if raw.get("dtype", "float32") not in ("float32", "float16", "bfloat16", "float64"):
            raise AloeSpecError(f"{source}: {CONFIG_KEY}.dtype: unsupported {raw.get('dtype')!r}")
        try:
            check_write_positions(raw.get("write_positions", DEFAULT_WRITE_POSITIONS))
        except ValueError as e:
            raise AloeSpecError(f"{source}: {CONFIG_KEY}.{e}") from None
        decay = raw.get("reading_decay", 0.0)
        try:
            if isinstance(decay, bool) or not isinstance(decay, (int, float)):
                raise ValueError(f"reading decay must be a number, got {decay!r}")
            check_decay(decay)
        except ValueError as e:
            raise AloeSpecError(f"{source}: {CONFIG_KEY}.reading_decay: {e}") from None
        return cls(**{k: raw[k] for k in raw})

    def check_model(self, *, num_layers: int, d: int, d_out: int, source: str = "config.json") -> None:
        """Refuse a spec that does not fit the base model's shapes."""
        if not 0 <= self.layer < num_layers:
            raise AloeSpecError(
                f"{source}: {CONFIG_KEY}.layer={self.layer} is out of range: the model has {num_layers} "
                f"decoder layers (0..{num_layers - 1})"
            )
        if (self.d, self.d_out) != (d, d_out):
            raise AloeSpecError(
                f"{source}: the operator maps d={self.d} to d_out={self.d_out}, but the model's down_proj maps "
                f"intermediate_size={d} to hidden_size={d_out}"
            )
