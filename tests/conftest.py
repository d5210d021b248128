"""Test set-up. TRITON_INTERPRET must be set before any Triton kernel is defined,
so that the fused kernel runs on CPU in the interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are noise in test logs

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

DATA_DIR = Path(os.environ.get("ALOE_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.skip(f"benchmark data not found at {DATA_DIR} (set ALOE_DATA_DIR)")
    return DATA_DIR


@pytest.fixture(params=["sparse", "fused"])
def residual_path(request, monkeypatch):
    """Run a test through the CPU sparse path and through the Triton kernel (interpreter)."""
    if request.param == "sparse":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        from aloe_kernels.ops import kernel_available

        if os.environ.get("TRITON_INTERPRET") != "1" or not kernel_available():
            pytest.skip("the fused kernel needs Triton and TRITON_INTERPRET=1 set before start-up on CPU")
    return request.param
