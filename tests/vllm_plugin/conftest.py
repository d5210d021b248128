"""Fixtures shared by the vLLM plugin tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def vllm_cache(tmp_path_factory) -> Path:
    """A private VLLM_CACHE_ROOT, so compiled-mode tests really compile."""
    return tmp_path_factory.mktemp("vllm-cache")
