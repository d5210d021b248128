"""The ALOE operator: tensors, per-edit metadata, and the on-disk artifact.

An artifact is a directory (like a PEFT adapter) holding

- ``aloe_config.json``: format version, base model, fingerprint of the edited
  weight, layer index and module path, d, d_out, n, eps, gate_eps, dtype,
  the reading's decay (format 2 only: what the gates read, see
  :mod:`aloe_kernels.reading`), and per-edit metadata (id, request, target, subject);
- ``aloe_operator.safetensors``: edit-major tensors ``addresses`` (n x d),
  ``thresholds`` (n), ``temperatures`` (n) and ``writes`` (n x d_out).

Nothing is ever unpickled: only JSON and safetensors are read.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from .errors import ArtifactError

#: the format an artifact is written in: 1 for the last-token reading, which every reader of ALOE
#: understands, 2 where the gates read a running mean (``reading_decay`` > 0)
FORMAT_VERSION = 1
READING_FORMAT_VERSION = 2
CONFIG_NAME = "aloe_config.json"
TENSORS_NAME = "aloe_operator.safetensors"
DEFAULT_EPS = 1e-6
DEFAULT_GATE_EPS = 1e-3
SUPPORTED_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in SUPPORTED_DTYPES.items()}
_TENSOR_FIELDS = ("addresses", "thresholds", "temperatures", "writes")


def weight_fingerprint(weight: torch.Tensor) -> str:
    """A fingerprint of a down-projection weight, given as (d_out, d).

    The weight is rounded to bfloat16 before hashing, so the same checkpoint
    loaded in float32, bfloat16 or float16-from-bf16 gives the same value.
    """
    w = weight.detach().to("cpu", torch.bfloat16).contiguous()
    digest = hashlib.sha256()
    digest.update(str(tuple(w.shape)).encode())
    digest.update(w.view(torch.int16).numpy().tobytes())
    return "sha256-bf16:" + digest.hexdigest()[:32]


def _default_edit_meta(i: int) -> dict[str, Any]:
    return {"id": f"edit-{i}", "request": None, "target": None, "subject": None}


@dataclasses.dataclass
class AloeOperator:
    """Gated low-rank edit operator for one MLP down-projection.

    ``out = W h + writes.T @ g(h)`` with
    ``g = max(sigmoid(temperatures * (addresses @ h / max(|h|, eps) - thresholds)) - gate_eps, 0) / (1 - gate_eps)``.

    Tensors are edit-major: ``addresses`` (n, d), ``thresholds`` (n),
    ``temperatures`` (n, all > 0), ``writes`` (n, d_out). ``edits`` holds one
    metadata dict per edit with at least a unique string ``id``.
    """

    addresses: torch.Tensor
    thresholds: torch.Tensor
    temperatures: torch.Tensor
    writes: torch.Tensor
    eps: float = DEFAULT_EPS
    gate_eps: float = DEFAULT_GATE_EPS
    edits: list[dict[str, Any]] | None = None
    layer: int | None = None
    module_path: str | None = None
    base_model: str | None = None
    weight_fingerprint: str | None = None
    reading_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.edits is None:
            self.edits = [_default_edit_meta(i) for i in range(self._rows())]
        else:
            self.edits = [dict(e) for e in self.edits]
        self.validate()

    @classmethod
    def unchecked(
        cls,
        addresses: torch.Tensor,
        thresholds: torch.Tensor,
        temperatures: torch.Tensor,
        writes: torch.Tensor,
        eps: float,
        gate_eps: float,
    ) -> "AloeOperator":
        """An operator over existing tensors, without validating or copying them.

        For hot paths (one call per forward) whose tensors were checked when
        they were loaded: validation reads every tensor and would cost more
        than the residual itself at decode.
        """
        op = object.__new__(cls)
        op.__dict__.update(
            addresses=addresses,
            thresholds=thresholds,
            temperatures=temperatures,
            writes=writes,
            eps=float(eps),
            gate_eps=float(gate_eps),
            edits=None,
            layer=None,
            module_path=None,
            base_model=None,
            weight_fingerprint=None,
            reading_decay=0.0,
        )
        return op

    # ------------------------------------------------------------------ shape
    def _rows(self) -> int:
        a = self.addresses
        return int(a.shape[0]) if isinstance(a, torch.Tensor) and a.dim() >= 1 else 0

    @property
    def n(self) -> int:
        """Number of edits (write columns)."""
        return int(self.addresses.shape[0])

    @property
    def d(self) -> int:
        """Input width of the edited down-projection (MLP intermediate size)."""
        return int(self.addresses.shape[1])

    @property
    def d_out(self) -> int:
        """Output width of the edited down-projection (model hidden size)."""
        return int(self.writes.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.addresses.dtype

    @property
    def device(self) -> torch.device:
        return self.addresses.device

    @property
    def ids(self) -> list[str]:
        return [str(e["id"]) for e in self.edits]

    # ------------------------------------------------------------- validation
    def validate(self, source: str = "AloeOperator") -> None:
        """Check shapes, dtypes, finiteness, temperatures and metadata.

        Raises :class:`ArtifactError` naming ``source``, the field and what was expected.
        """

        def fail(field: str, msg: str) -> None:
            raise ArtifactError(f"{source}: field '{field}': {msg}")

        for name in _TENSOR_FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _DTYPE_NAMES:
                fail(name, f"expected one of {sorted(SUPPORTED_DTYPES)}, got {t.dtype}")
        if self.addresses.dim() != 2:
            fail("addresses", f"expected shape (n, d), got {tuple(self.addresses.shape)}")
        n, d = self.addresses.shape
        if d < 1:
            fail("addresses", "expected d >= 1")
        for name in ("thresholds", "temperatures"):
            t = getattr(self, name)
            if tuple(t.shape) != (n,):
                fail(name, f"expected shape ({n},) to match addresses, got {tuple(t.shape)}")
        if self.writes.dim() != 2 or self.writes.shape[0] != n or self.writes.shape[1] < 1:
            fail("writes", f"expected shape ({n}, d_out), got {tuple(self.writes.shape)}")
        dtypes = {getattr(self, k).dtype for k in _TENSOR_FIELDS}
        if len(dtypes) != 1:
            fail("dtype", f"all tensors must share one dtype, got {sorted(map(str, dtypes))}")
        devices = {getattr(self, k).device for k in _TENSOR_FIELDS}
        if len(devices) != 1:
            fail("device", f"all tensors must be on one device, got {sorted(map(str, devices))}")
        for name in _TENSOR_FIELDS:
            t = getattr(self, name)
            if t.numel() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                fail(name, f"expected finite values, found {bad} NaN/Inf entries")
        if n and not bool((self.temperatures > 0).all()):
            fail("temperatures", "expected every temperature > 0")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps > 0):
            fail("eps", f"expected a finite float > 0, got {self.eps!r}")
        if not (isinstance(self.gate_eps, (int, float)) and 0 <= self.gate_eps < 1):
            fail("gate_eps", f"expected a float in [0, 1), got {self.gate_eps!r}")
        if not isinstance(self.edits, list) or len(self.edits) != n:
            got = len(self.edits) if isinstance(self.edits, list) else type(self.edits).__name__
            fail("edits", f"expected {n} metadata entries (one per edit), got {got}")
        seen: set[str] = set()
        for i, e in enumerate(self.edits):
            if not isinstance(e, Mapping) or "id" not in e:
                fail("edits", f"entry {i}: expected a mapping with an 'id'")
            eid = str(e["id"])
            if eid in seen:
                fail("edits", f"entry {i}: duplicate edit id {eid!r}")
            seen.add(eid)
        if not (isinstance(self.reading_decay, (int, float)) and 0 <= self.reading_decay < 1):
            fail("reading_decay", f"expected a float in [0, 1), got {self.reading_decay!r}")
        if self.layer is not None and (not isinstance(self.layer, int) or self.layer < 0):
            fail("layer", f"expected a non-negative int, got {self.layer!r}")

    # ------------------------------------------------------------ conversions
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "AloeOperator":
        """A copy with tensors on ``device`` and/or in ``dtype`` (metadata shared by value)."""
        kw = {k: getattr(self, k).to(device=device, dtype=dtype) for k in _TENSOR_FIELDS}
        return dataclasses.replace(self, **kw, edits=copy.deepcopy(self.edits))

    def _header(self) -> dict[str, Any]:
        return {
            "eps": self.eps,
            "gate_eps": self.gate_eps,
            "layer": self.layer,
            "module_path": self.module_path,
            "base_model": self.base_model,
            "weight_fingerprint": self.weight_fingerprint,
            "reading_decay": self.reading_decay,
        }

    # -------------------------------------------------------------- editing
    def select(self, rows: Sequence[int] | torch.Tensor) -> "AloeOperator":
        """A new operator holding only the given edit rows, in that order."""
        idx = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, dtype=torch.long)
        kw = {k: getattr(self, k).index_select(0, idx.to(self.device)).clone() for k in _TENSOR_FIELDS}
        edits = [copy.deepcopy(self.edits[int(i)]) for i in idx.tolist()]
        return AloeOperator(**kw, edits=edits, **self._header())

    def remove(self, ids: Iterable[str]) -> "AloeOperator":
        """A new operator without the edits whose ids are given; unknown ids raise."""
        drop = {str(i) for i in ids}
        unknown = drop - set(self.ids)
        if unknown:
            raise ArtifactError(f"remove: unknown edit ids {sorted(unknown)}")
        return self.select([i for i, e in enumerate(self.ids) if e not in drop])

    def append(self, other: "AloeOperator") -> "AloeOperator":
        """A new operator with ``other``'s edits after this one's (no rebuild)."""
        return AloeOperator.merge([self, other])

    @staticmethod
    def merge(operators: Sequence["AloeOperator"]) -> "AloeOperator":
        """Concatenate operators built for the same layer of the same model.

        They must agree on d, d_out, eps, gate_eps, layer, module path and
        fingerprint (where set), and their edit ids must be distinct. The
        result takes the dtype and device of the first operator.
        """
        if not operators:
            raise ArtifactError("merge: expected at least one operator")
        first = operators[0]
        header = first._header()
        for j, op in enumerate(operators[1:], start=1):
            if (op.d, op.d_out) != (first.d, first.d_out):
                raise ArtifactError(
                    f"merge: operator {j} has (d, d_out)=({op.d}, {op.d_out}), expected ({first.d}, {first.d_out})"
                )
            for key, value in op._header().items():
                if key == "base_model":
                    continue
                if value is not None and header[key] is not None and value != header[key]:
                    raise ArtifactError(f"merge: operator {j} has {key}={value!r}, expected {header[key]!r}")
                if header[key] is None:
                    header[key] = value
        kw = {k: torch.cat([getattr(op, k).to(first.device, first.dtype) for op in operators], 0) for k in _TENSOR_FIELDS}
        edits = [copy.deepcopy(e) for op in operators for e in op.edits]
        return AloeOperator(**kw, edits=edits, **header)

    # ------------------------------------------------------------------- io
    def save(self, path: str | os.PathLike) -> Path:
        """Write the artifact directory (created if needed); returns its path."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        version = READING_FORMAT_VERSION if self.reading_decay else FORMAT_VERSION
        header = self._header()
        if not self.reading_decay:
            del header["reading_decay"]  # a last-token artifact stays readable by every version
        config = {
            "format_version": version,
            **header,
            "d": self.d,
            "d_out": self.d_out,
            "n": self.n,
            "dtype": _DTYPE_NAMES[self.dtype],
            "edits": self.edits,
        }
        tensors = {k: getattr(self, k).detach().to("cpu").contiguous() for k in _TENSOR_FIELDS}
        # Write to temporary names first so that an interrupted save never
        # leaves a half-written artifact behind a valid-looking config.
        tmp_t = out / (TENSORS_NAME + ".tmp")
        tmp_c = out / (CONFIG_NAME + ".tmp")
        save_file(tensors, str(tmp_t), metadata={"format_version": str(version)})
        tmp_c.write_text(json.dumps(config, indent=1, ensure_ascii=False))
        os.replace(tmp_t, out / TENSORS_NAME)
        os.replace(tmp_c, out / CONFIG_NAME)
        return out

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        device: torch.device | str = "cpu",
        expected_fingerprint: str | None = None,
    ) -> "AloeOperator":
        """Read and validate an artifact directory.

        ``expected_fingerprint`` (see :func:`weight_fingerprint`) is compared
        with the stored one when both are known.
        """
        root = Path(path)
        cfg_path, t_path = artifact_files(root)
        try:
            config = json.loads(cfg_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{cfg_path}: not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise ArtifactError(f"{cfg_path}: expected a JSON object")
        version = config.get("format_version")
        if version not in (FORMAT_VERSION, READING_FORMAT_VERSION):
            raise ArtifactError(
                f"{cfg_path}: field 'format_version': expected {FORMAT_VERSION} or {READING_FORMAT_VERSION}, got {version!r}"
            )
        if version == FORMAT_VERSION and config.get("reading_decay"):
            raise ArtifactError(f"{cfg_path}: field 'reading_decay': a format {FORMAT_VERSION} artifact reads the last token")
        for key in ("d", "d_out", "n", "dtype", "eps", "gate_eps", "edits"):
            if key not in config:
                raise ArtifactError(f"{cfg_path}: field '{key}' missing")
        tensors = _read_safetensors(t_path)
        for name in _TENSOR_FIELDS:
            if name not in tensors:
                raise ArtifactError(f"{t_path}: field '{name}': tensor missing")
        want_dtype = SUPPORTED_DTYPES.get(config["dtype"])
        if want_dtype is None:
            raise ArtifactError(f"{cfg_path}: field 'dtype': expected one of {sorted(SUPPORTED_DTYPES)}, got {config['dtype']!r}")
        n, d, d_out = config["n"], config["d"], config["d_out"]
        expected_shapes = {"addresses": (n, d), "thresholds": (n,), "temperatures": (n,), "writes": (n, d_out)}
        for name, shape in expected_shapes.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(shape):
                raise ArtifactError(
                    f"{t_path}: field '{name}': expected shape {tuple(shape)} (from {CONFIG_NAME}), got {tuple(t.shape)}"
                )
            if t.dtype != want_dtype:
                raise ArtifactError(f"{t_path}: field '{name}': expected dtype {config['dtype']}, got {t.dtype}")
        stored_fp = config.get("weight_fingerprint")
        if expected_fingerprint and stored_fp and expected_fingerprint != stored_fp:
            raise ArtifactError(
                f"{cfg_path}: field 'weight_fingerprint': the operator was built for a weight with "
                f"fingerprint {stored_fp}, but the target weight has {expected_fingerprint} (wrong model or layer?)"
            )
        try:
            return cls(
                **{k: tensors[k].to(device) for k in _TENSOR_FIELDS},
                eps=float(config["eps"]),
                gate_eps=float(config["gate_eps"]),
                edits=config["edits"],
                layer=config.get("layer"),
                module_path=config.get("module_path"),
                base_model=config.get("base_model"),
                weight_fingerprint=stored_fp,
                reading_decay=float(config.get("reading_decay", 0.0)),
            )
        except ArtifactError as exc:
            raise ArtifactError(f"{root}: {exc}") from exc

    def fingerprint(self) -> str:
        """A content hash of the operator (tensors and edit ids), for reports."""
        digest = hashlib.sha256()
        for name in _TENSOR_FIELDS:
            t = getattr(self, name).detach().to("cpu").contiguous()
            digest.update(name.encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        digest.update(json.dumps(self.ids).encode())
        return digest.hexdigest()[:16]


def artifact_files(path: str | os.PathLike) -> tuple[Path, Path]:
    """The config and tensor files of the artifact directory ``path``; ArtifactError if one is missing."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root}: expected an ALOE artifact directory")
    files = (root / CONFIG_NAME, root / TENSORS_NAME)
    for p in files:
        if not p.is_file():
            raise ArtifactError(f"{p}: file missing from the artifact")
    return files


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ArtifactError(f"{path}: not a readable safetensors file ({exc})") from exc
