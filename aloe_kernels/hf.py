"""Drop-in patch of a Hugging Face causal LM: one MLP down-projection gains U g(h).

``apply_aloe`` replaces the module in its parent with :class:`AloeDownProj`,
a thin wrapper that calls the original module and then adds the ALOE
residual; ``remove_aloe`` puts the original module object back, so outputs
are restored bit for bit. Works on an already-built model; nothing here
imports transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
from torch import nn

from .errors import PatchError
from .int8_addresses import kernel_screen
from .operator import AloeOperator, weight_fingerprint
from .reading import ReadingTracker, attach_reading, detach_reading
from .reference import aloe_reference
from .residual import aloe_residual_
from .runtime import STREAM_MAX_TOKENS, kernel_dtypes, use_fused_kernel
from .screened import SCREEN_MIN_EDITS
from .screened_int8 import Int8Screen, int8_screen_supported, int8_screened_residual_
from .write_positions import DEFAULT_WRITE_POSITIONS, add_at_written_positions, check_write_positions

# Where decoder layers live, and where the down-projection sits inside one layer.
_LAYER_LISTS = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "transformer.h",
    "model.decoder.layers",
)
_DOWN_PROJ_NAMES = ("mlp.down_proj", "mlp.c_proj")
_TENSORS = ("addresses", "thresholds", "temperatures", "writes")


@dataclasses.dataclass
class DownProjSite:
    """A located down-projection: its dotted path, parent, attribute name and module."""

    path: str
    parent: nn.Module
    attr: str
    module: nn.Module
    num_layers: int

    @property
    def base(self) -> nn.Module:
        """The down-projection itself, under an ALOE wrapper if the model is patched."""
        return self.module.base if isinstance(self.module, AloeDownProj) else self.module

    @property
    def is_conv1d(self) -> bool:
        """GPT-2's Conv1D stores its weight as (d, d_out), the transpose of nn.Linear."""
        return type(self.base).__name__ == "Conv1D"

    def weight(self) -> torch.Tensor:
        """The weight as (d_out, d), whatever the module's own layout."""
        w = self.base.weight
        return w.T if self.is_conv1d else w

    @property
    def d(self) -> int:
        return int(self.weight().shape[1])

    @property
    def d_out(self) -> int:
        return int(self.weight().shape[0])


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The dotted path and ModuleList of a causal LM's decoder layers."""
    for path in _LAYER_LISTS:
        layers = _get(model, path)
        if isinstance(layers, nn.ModuleList):
            return path, layers
    raise PatchError(f"{type(model).__name__}: no decoder layer list found (looked for {', '.join(_LAYER_LISTS)})")


def locate_down_proj(model: nn.Module, layer: int) -> DownProjSite:
    """Find the MLP down-projection of decoder layer ``layer``.

    Supports ``mlp.down_proj`` (Llama, Mistral, Qwen2, Qwen3, Gemma 3) and
    GPT-2's Conv1D ``mlp.c_proj``. The module found may already be an
    :class:`AloeDownProj`.
    """
    path, layers = decoder_layers(model)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise PatchError(f"layer must be an int, got {layer!r}")
    if not 0 <= layer < len(layers):
        raise PatchError(f"layer {layer} is out of range: the model has {len(layers)} decoder layers (0..{len(layers) - 1})")
    block = layers[layer]
    for name in _DOWN_PROJ_NAMES:
        module = _get(block, name)
        if isinstance(module, nn.Module):
            parent_name, attr = name.rsplit(".", 1)
            return DownProjSite(f"{path}.{layer}.{name}", _get(block, parent_name), attr, module, len(layers))
    raise PatchError(
        f"{type(model).__name__}: decoder layer {layer} has no MLP down-projection (looked for {', '.join(_DOWN_PROJ_NAMES)})"
    )


class AloeDownProj(nn.Module):
    """Wraps a down-projection: ``forward(h) = base(h) + U g(h)``.

    The operator tensors are non-persistent buffers (they move with
    ``model.to(device)`` and stay out of the model's state dict). With
    autograd recording and a tensor requiring grad, the residual is added
    out of place through the reference math so gradients flow; otherwise it
    is added in place by :func:`aloe_residual_`, or, on CPU with a float32
    operator, through the exact int8 screen (:mod:`aloe_kernels.screened_int8`)
    when ``screen`` is True, or None and the operator holds at least
    :data:`~aloe_kernels.screened.SCREEN_MIN_EDITS` edits. ``write_positions`` picks the positions
    that receive the residual (:mod:`aloe_kernels.write_positions`). ``reading``: where the operator's
    gates read a running mean (:mod:`aloe_kernels.reading`), the model's tracker; the gates then read
    it in place of ``h``, and ``base`` still maps ``h``.
    """

    def __init__(
        self,
        base: nn.Module,
        op: AloeOperator,
        deterministic: bool = False,
        screen: bool | None = None,
        int8_addresses: bool = False,
        write_positions: str = DEFAULT_WRITE_POSITIONS,
        reading: ReadingTracker | None = None,
    ):
        super().__init__()
        self.base = base
        self.reading = reading
        self.write_positions = check_write_positions(write_positions)
        self.write_starts: torch.Tensor | None = None  # set by written_from()
        self.deterministic = deterministic
        self.screen = screen
        self.int8_addresses = int8_addresses
        self._op_header = {f.name: getattr(op, f.name) for f in dataclasses.fields(op) if f.name not in _TENSORS}
        for k in _TENSORS:
            self.register_buffer(k, getattr(op, k), persistent=False)
        self._refresh_runtime_op()

    @property
    def operator(self) -> AloeOperator:
        """The operator as currently held (device and dtype of the buffers)."""
        return AloeOperator(**{k: getattr(self, k) for k in _TENSORS}, **self._op_header)

    def _refresh_runtime_op(self) -> None:
        # The unvalidated operator of the hot path (the tensors were validated at patch time), made when
        # the buffers change rather than in forward: torch.compile(fullgraph=True) cannot trace making it.
        self._runtime_op = AloeOperator.unchecked(
            *(getattr(self, k) for k in _TENSORS), eps=self._op_header["eps"], gate_eps=self._op_header["gate_eps"]
        )
        op = self._runtime_op
        self._int8_screen = (
            Int8Screen.prepare(op.addresses, op.thresholds, op.temperatures, op.gate_eps) if self._screens(op) else None
        )
        self._stream_screen = self._int8_stream_screen(op)

    def _int8_stream_screen(self, op: AloeOperator) -> tuple | None:
        """(values, scales, limits) of the int8 addresses for the fused decode path, when asked and usable."""
        if not self.int8_addresses or not use_fused_kernel(op.addresses) or not kernel_dtypes(op.addresses, op.writes):
            return None
        return kernel_screen(op)

    def _screens(self, op: AloeOperator) -> bool:
        if self.screen is False or op.addresses.device.type != "cpu" or op.addresses.dtype != torch.float32:
            return False
        return int8_screen_supported() and (self.screen is True or op.n >= SCREEN_MIN_EDITS)

    def _apply(self, fn, recurse=True):  # model.to(device/dtype) replaces the buffers
        out = super()._apply(fn, recurse)
        self._refresh_runtime_op()
        return out

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in _TENSORS and "_runtime_op" in self.__dict__:
            self._refresh_runtime_op()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.base(h)
        read = h if self.reading is None else self.reading.read(h)
        if self.write_positions == "all":
            return self._add_residual(y, read)
        return add_at_written_positions(y, read, self._add_residual, self.write_starts)

    def _add_residual(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        op = self._runtime_op
        if torch.is_grad_enabled() and (h.requires_grad or any(getattr(self, k).requires_grad for k in _TENSORS)):
            return y + aloe_reference(h, op).to(y.dtype)
        if self._stream_screen is not None and h.numel() <= STREAM_MAX_TOKENS * op.d and y.is_contiguous():
            from .ops.stream_gate import aloe_stream_screened_residual_

            return aloe_stream_screened_residual_(
                y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps, self._stream_screen
            )
        if self._int8_screen is not None and not use_fused_kernel(h):
            return int8_screened_residual_(
                y, h, self._int8_screen, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps
            )
        return aloe_residual_(y, h, op, deterministic=self.deterministic)


def find_aloe_modules(model: nn.Module) -> list[tuple[str, AloeDownProj]]:
    """Every ALOE wrapper in the model, with its dotted name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AloeDownProj)]


@contextlib.contextmanager
def written_from(model: nn.Module, starts: torch.Tensor) -> Iterator[None]:
    """Within the context, a forward call over a batch writes row b's residual from position
    ``starts[b]`` on (index into the padded sequence; the prompt's last token when a continuation is
    scored teacher-forced), as generation would have. No effect on a model without ALOE or with
    ``write_positions="all"``."""
    modules = [m for _, m in find_aloe_modules(model)]
    for m in modules:
        m.write_starts = starts
    try:
        yield
    finally:
        for m in modules:
            m.write_starts = None


def apply_aloe(
    model: nn.Module,
    op: AloeOperator,
    layer: int | None = None,
    check_fingerprint: bool = True,
    deterministic: bool = False,
    dtype: torch.dtype | None = None,
    screen: bool | None = None,
    int8_addresses: bool = False,
    write_positions: str = DEFAULT_WRITE_POSITIONS,
) -> AloeDownProj:
    """Patch ``model`` in place so that one down-projection adds ``U g(h)``.

    ``layer`` defaults to the operator's own layer. The operator is moved to
    the weight's device. ``dtype=None`` keeps it as served: float32 on CPU
    (float64 stays), the weight's dtype elsewhere, thresholds and temperatures
    included; an explicit ``dtype`` (e.g. ``torch.bfloat16`` on CPU, to
    reproduce a GPU's numbers) overrides that. ``screen`` picks the CPU path of a float32
    operator: the exact int8 screen when True, the plain fp32 product when False, and when None
    (default) the screen from :data:`~aloe_kernels.screened.SCREEN_MIN_EDITS` edits up (same
    gates either way; the screen is several times faster at decode). ``int8_addresses``: where the
    fused kernel runs (CUDA), calls of at most 32 tokens stream an int8 copy of the addresses first
    and read only the rows it keeps (:mod:`aloe_kernels.int8_addresses`; the same output bits as the
    streaming decode kernel without it); quantised here, from the operator as given.
    ``write_positions``: ``"generated"`` (default) adds the residual only where the next token is
    generated, ``"all"`` at every position (:mod:`aloe_kernels.write_positions`). An operator whose
    gates read a running mean (``op.reading_decay`` > 0) makes the model track it
    (:func:`aloe_kernels.reading.attach_reading`; undone by :func:`remove_aloe`). Refuses, with a
    :class:`PatchError`, a layer out of range, a d/d_out mismatch, a
    fingerprint mismatch (when the operator records one and
    ``check_fingerprint``), and a model that is already patched.
    """
    if not isinstance(op, AloeOperator):
        raise PatchError(f"expected an AloeOperator, got {type(op).__name__}")
    existing = find_aloe_modules(model)
    if existing:
        raise PatchError(f"model is already patched with ALOE at {existing[0][0]}; call remove_aloe(model) first")
    if layer is None:
        layer = op.layer
    if layer is None:
        raise PatchError("no layer given and the operator does not record one")
    site = locate_down_proj(model, layer)
    if op.layer is not None and layer != op.layer:
        raise PatchError(f"the operator was built for layer {op.layer}, not layer {layer}")
    if (site.d, site.d_out) != (op.d, op.d_out):
        raise PatchError(f"{site.path} maps d={site.d} to d_out={site.d_out}, but the operator has d={op.d}, d_out={op.d_out}")
    if check_fingerprint and op.weight_fingerprint:
        found = weight_fingerprint(site.weight())
        if found != op.weight_fingerprint:
            raise PatchError(
                f"{site.path}: weight fingerprint {found} does not match the operator's {op.weight_fingerprint} "
                f"(built for {op.base_model or 'another model'}); pass check_fingerprint=False only if you know why"
            )
    w = site.weight()
    if dtype is None:
        dtype = op.dtype if op.dtype == torch.float64 else (torch.float32 if w.device.type == "cpu" else w.dtype)
    reading = attach_reading(model, op.reading_decay)
    try:
        wrapper = AloeDownProj(
            site.module,
            op.to(w.device, dtype),
            deterministic=deterministic,
            screen=screen,
            int8_addresses=int8_addresses,
            write_positions=write_positions,
            reading=reading,
        )
    except BaseException:
        if reading is not None:
            detach_reading(model)
        raise
    setattr(site.parent, site.attr, wrapper)
    return wrapper


def remove_aloe(model: nn.Module) -> int:
    """Undo :func:`apply_aloe`: restore every original module object. Returns how many were removed."""
    removed = 0
    for name, wrapper in find_aloe_modules(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, wrapper.base)
        if wrapper.reading is not None:
            detach_reading(model)
        removed += 1
    return removed
