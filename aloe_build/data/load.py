"""Reading edit files and :func:`load_edits`, which dispatches each record to its format's parser.

A file is a ``.json`` list of records (or an object wrapping one, or one record) or
JSON Lines (``.jsonl``/``.ndjson``, or a ``.json`` file that holds one object per
line). ids: ``str(case_id)`` when the record has one (``id`` in our own format),
else ``f"{file stem}-{index}"`` (index of the record in the file, 0-based).
Duplicate ids are an error.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .counterfact import _parse_easyedit, _parse_rome
from .detect import _detect_one, _detect_record
from .fields import _Ctx
from .jsonl import _parse_aloe
from .knowedit import _parse_knowedit, _parse_wikibio
from .requests import EditDataError, EditRequest, PathLike
from .zsre import _parse_zsre


def read_text(path: Path) -> str:
    """A file's UTF-8 text, decompressed when its name ends in ``.gz`` (the bundled corpus ships so)."""
    if path.name.endswith(".gz"):
        import gzip

        try:
            return gzip.decompress(path.read_bytes()).decode("utf-8")
        except (gzip.BadGzipFile, EOFError) as e:
            raise EditDataError(f"{path}: not a readable gzip file ({e})") from None
    return path.read_text(encoding="utf-8")


def _read_records(path: Path) -> Iterator[tuple[Any, int | None]]:
    """Yield (raw record, JSONL line number or None) from a JSON or JSONL file."""
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise EditDataError(f"{path}: edit file not found") from None
    except IsADirectoryError:
        raise EditDataError(f"{path}: is a directory, expected a .json or .jsonl edit file") from None
    except UnicodeDecodeError as e:
        raise EditDataError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise EditDataError(f"{path}: cannot read ({e})") from None

    is_jsonl = Path(path.name.removesuffix(".gz")).suffix.lower() in (".jsonl", ".ndjson")
    if not is_jsonl:
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            # A .json file that is really JSON Lines (several objects, one per line)?
            first = text.lstrip().splitlines()[0] if text.strip() else ""
            if e.msg == "Extra data" and first.startswith("{"):
                is_jsonl = True
            else:
                raise EditDataError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        if not is_jsonl:
            for rec in _unwrap(data, path):
                yield rec, None
            return

    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise EditDataError(f"{path}: line {lineno}: invalid JSON at column {e.colno}: {e.msg}") from None
        yield rec, lineno


def _unwrap(data: Any, path: Path) -> list[Any]:
    """The list of records in a parsed JSON document (a list, a dict wrapping one, or one record)."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        if _detect_one(data) is not None:  # a single record
            return [data]
        lists = {k: v for k, v in data.items() if isinstance(v, list) and (not v or isinstance(v[0], dict))}
        if len(lists) == 1:
            return next(iter(lists.values()))
        for key in ("data", "records", "edits", "requests"):
            if key in lists:
                return lists[key]
        if not lists:
            raise EditDataError(
                f"{path}: the top-level JSON object holds no list of records "
                f"(keys: {sorted(data)[:20]}); expected a list of edit records or an object wrapping one"
            )
        raise EditDataError(
            f"{path}: the top-level JSON object holds several lists of records {sorted(lists)}; "
            f"cannot tell which one holds the edits"
        )
    raise EditDataError(f"{path}: expected a JSON list of edit records, got a JSON {type(data).__name__}")


_PARSERS = {
    "counterfact_rome": _parse_rome,
    "counterfact_easyedit": _parse_easyedit,
    "zsre_mend": _parse_zsre,
    "knowedit_zsre": _parse_knowedit,
    "knowedit_wikidata_counterfact": _parse_knowedit,
    "knowedit_wikidata_recent": _parse_knowedit,
    "knowedit_wikibio": _parse_wikibio,
    "aloe_jsonl": _parse_aloe,
}


def _record_id(rec: Mapping[str, Any], fmt: str, stem: str, index: int) -> str:
    key = "id" if fmt == "aloe_jsonl" else "case_id"
    v = rec.get(key)
    if v is None and fmt != "aloe_jsonl":
        v = rec.get("id")
    if v is None or (isinstance(v, str) and not v.strip()):
        return f"{stem}-{index}"
    return str(v).strip()


def load_edits(path: PathLike, limit: int | None = None, *, skip_invalid: bool = False) -> list[EditRequest]:
    """Load edit requests from a benchmark file, detecting its format.

    Args:
        path: a ``.json`` file (a list of records, or an object wrapping one) or a
            ``.jsonl`` file (one record per line) in any of :data:`FORMATS`.
        limit: return at most the first ``limit`` edits (``None``: all). Records
            after that are not parsed.
        skip_invalid: drop records that fail validation (missing field, empty
            target, duplicate id) with one warning, instead of raising. Some
            published files have such records (e.g. two zsRE MEND records with an
            empty ``alt``). With ``limit``, the first ``limit`` valid edits are returned.

    Returns:
        The edits, in file order, each with ``source`` set to the format name
        (JSONL written by :func:`save_edits_jsonl` keeps the original ``source``).

    Raises:
        EditDataError: the file is missing or unreadable, is not valid JSON (the
            JSONL line is named), has an unrecognised format (the record and the
            fields seen vs expected are named), or a record is missing a required
            field or has an empty target (the record index, id and field are named).
        ValueError: ``limit`` is negative.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    p = Path(path)
    stem = p.stem
    out: list[EditRequest] = []
    if limit == 0:
        if not p.is_file():
            raise EditDataError(f"{p}: edit file not found")
        return out
    fmt: str | None = None
    seen_ids: dict[str, int] = {}
    skipped: list[str] = []
    for index, (rec, lineno) in enumerate(_read_records(p)):
        where = f"{p}: record {index}" + (f" (line {lineno})" if lineno is not None else "")
        if fmt is None:
            fmt = _detect_record(rec, where)
        elif not isinstance(rec, Mapping):
            err = EditDataError(f"{where}: expected a JSON object, got a JSON {type(rec).__name__}")
            if not skip_invalid:
                raise err
            skipped.append(str(err))
            continue
        try:
            rec_id = _record_id(rec, fmt, stem, index)
            ctx = _Ctx(p, index, lineno, rec_id)
            if rec_id in seen_ids:
                raise ctx.error(f"duplicate id {rec_id!r} (first used by record {seen_ids[rec_id]})")
            try:
                edit = _PARSERS[fmt](rec, ctx, fmt)
            except EditDataError:
                raise
            except (TypeError, ValueError) as e:
                raise ctx.error(str(e)) from None
        except EditDataError as e:
            if not skip_invalid:
                raise EditDataError(f"{e} (format {fmt}; pass skip_invalid=True to drop invalid records)") from None
            skipped.append(str(e))
            continue
        seen_ids[rec_id] = index
        out.append(edit)
        if limit is not None and len(out) >= limit:
            break
    if skipped:
        more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
        warnings.warn(
            f"{p}: skipped {len(skipped)} invalid record(s): " + "; ".join(skipped[:3]) + more,
            stacklevel=2,
        )
    return out
