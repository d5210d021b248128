"""The one short hash that an evaluation's saved parts and caches are named and checked by."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def content_key(content: Any) -> str:
    """A short hash of ``content`` (anything JSON can write, through ``str`` where it cannot)."""
    blob = json.dumps(content, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]
