"""Files a build writes without ever leaving a partial one: stage checkpoints and cached tensors.

Each stage's output is a safetensors file plus a JSON record keyed by a hash
of the requests, the edited weight and the configuration fields of that
stage and the ones before it (``BuildConfig.fields_up_to``): an interrupted
build resumes at the first stage without a valid checkpoint, and changing a
later stage's settings keeps the earlier stages.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .config import BuildConfig


def write_atomically(file: Path, write: Callable[[Path], object], every_rank: bool = False) -> None:
    """``write(tmp)`` under a private temporary name beside ``file``, then rename it into place:
    concurrent builds sharing a cache never read a partial file nor clobber each other's. In a
    distributed build only rank 0 writes (every rank holds the same result), unless ``every_rank``
    (a piece of work that only its rank holds)."""
    if not (every_rank or distributed.is_main()):
        return
    tmp = file.parent / f".{file.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB pieces; of its decompressed bytes when its name ends
    in ``.gz``, so that a file keys the same caches compressed or not."""
    import gzip

    h = hashlib.sha256()
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_tensors_atomically(
    tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None, every_rank: bool = False
) -> None:
    """A safetensors file (with its string ``metadata``) written through :func:`write_atomically`, its
    folder made if need be."""
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), every_rank)


def load_tensors(file: Path | None) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The tensors and the string metadata of a safetensors ``file`` written by
    :func:`save_tensors_atomically`; None when there is no such file (or ``file`` is None)."""
    if file is None or not file.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


def cached_tensor(file: Path, compute: Callable[[], torch.Tensor], name: str = "states") -> torch.Tensor:
    """The tensor ``name`` read from the safetensors ``file``, or computed by ``compute()`` and written
    there atomically (a cache shared by builds and evaluations: concurrent writers never clobber it)."""
    from safetensors.torch import load_file

    if distributed.all_agree(file.is_file()):  # every rank computes it, or none (its passes are shared)
        return load_file(str(file))[name]
    value = compute()
    save_tensors_atomically({name: value.contiguous()}, file)
    return value


#: Bump when what a stage stores changes, so that older checkpoints are recomputed, not misread.
CHECKPOINT_FORMAT = 2


def run_key(requests: Sequence[Any], fingerprint: str, layer: int, base: str = "") -> str:
    """Hash of the edit requests, the edited weight, the layer and (for an append) the hash of the
    operator appended to: what every checkpoint depends on."""
    h = hashlib.sha256()
    h.update(json.dumps([r.to_dict() for r in requests], sort_keys=True, ensure_ascii=False).encode())
    h.update(f"{fingerprint}:{layer}:{CHECKPOINT_FORMAT}:{base}".encode())
    return h.hexdigest()[:16]


class StageCheckpoints:
    """Stage outputs in ``root``, valid only for the same requests and configuration
    (``root`` None: nothing is written or read)."""

    def __init__(self, root: Path | None, key: str, cfg: BuildConfig):
        self.root, self.base_key, self.cfg = root, key, cfg
        self._opened: dict[str, list[PartStore]] = {}
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def key(self, stage: str) -> str:
        """The key of a stage named ``"<number>_<name>"``."""
        fields = self.cfg.fields_up_to(int(stage.split("_")[0]))
        return hashlib.sha256(json.dumps([self.base_key, fields], sort_keys=True).encode()).hexdigest()[:16]

    def _paths(self, stage: str) -> tuple[Path, Path]:
        assert self.root is not None
        return self.root / f"{stage}.safetensors", self.root / f"{stage}.json"

    def load(self, stage: str) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The stage's tensors and record, or None when there is no valid checkpoint."""
        if self.root is None:
            return None
        t_path, j_path = self._paths(stage)
        if not (t_path.is_file() and j_path.is_file()):
            return None
        meta = json.loads(j_path.read_text())
        if meta.get("key") != self.key(stage):
            return None
        from safetensors.torch import load_file

        return load_file(str(t_path)), meta

    def save(self, stage: str, tensors: dict[str, torch.Tensor], **meta: Any) -> None:
        if self.root is None:
            return
        t_path, j_path = self._paths(stage)
        save_tensors_atomically({k: v.contiguous() for k, v in tensors.items()}, t_path)
        text = json.dumps({"key": self.key(stage), **meta})
        write_atomically(j_path, lambda tmp: tmp.write_text(text))

    def parts(self, stage: str) -> "PartStore":
        """Where ``stage`` keeps the pieces of its work as they finish (see :class:`PartStore`)."""
        store = PartStore(self.root / f"{stage}.parts" if self.root is not None else None, self.key(stage))
        self._opened.setdefault(stage, []).append(store)
        return store

    def read_back(self, stage: str) -> int:
        """How many pieces of ``stage``'s work were read back rather than computed in this run: a
        stage resumed inside took less time than a whole one."""
        return sum(store.read_back for store in self._opened.get(stage, []))

    def drop_parts(self, stage: str) -> None:
        """Remove the pieces of a stage whose checkpoint now holds the whole result."""
        if self.root is not None and distributed.is_main():
            shutil.rmtree(self.root / f"{stage}.parts", ignore_errors=True)


class PartStore:
    """Pieces of one stage's work, each saved as it finishes, so that an interrupted stage resumes
    inside: a piece found here under the stage's current key is read instead of recomputed
    (``root`` None: nothing is kept). Pieces of another key are removed on opening."""

    def __init__(self, root: Path | None, key: str):
        self.root, self.key = root, key
        self.read_back = 0  # pieces read back rather than computed
        if root is None:
            return
        stamp = root / "key.json"
        if distributed.is_main():
            if root.is_dir() and (not stamp.is_file() or json.loads(stamp.read_text()).get("key") != key):
                shutil.rmtree(root)
            if not root.is_dir():
                root.mkdir(parents=True)
                write_atomically(stamp, lambda tmp: tmp.write_text(json.dumps({"key": key})))
        distributed.barrier()  # no rank reads the folder before rank 0 has cleared it

    def has(self, name: str) -> bool:
        return self.root is not None and (self.root / f"{name}.safetensors").is_file()

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        if not self.has(name):
            return None
        from safetensors.torch import load_file

        self.read_back += 1
        return load_file(str(self.root / f"{name}.safetensors"))

    def put(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.root is not None:
            # each rank keeps the pieces it computed (their names differ: see aloe_build.chunked)
            tensors = {k: v.contiguous() for k, v in tensors.items()}
            save_tensors_atomically(tensors, self.root / f"{name}.safetensors", every_rank=True)

    def cached(self, name: str, compute: Callable[[], dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], bool]:
        """The piece ``name``: read back, or computed and saved; and whether it was read back."""
        found = self.get(name)
        if found is not None:
            return found, True
        out = compute()
        self.put(name, out)
        return out, False
