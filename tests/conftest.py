"""Test set-up. TRITON_INTERPRET must be set before any Triton kernel is defined,
so that the fused kernel runs on CPU in the interpreter.

``ALOE_TEST_DEVICE=cuda`` runs the same test files on a GPU instead: the kernels
are compiled (TRITON_INTERPRET=0), tensors are created on CUDA by default, and
tensors drawn from a CPU ``torch.Generator`` are drawn on CPU, then moved, so the
test data are the same numbers as on CPU.
"""

import functools
import os

TEST_DEVICE = os.environ.get("ALOE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels: the interpreter would hide compile-time errors
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are noise in test logs

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from aloe_kernels.runtime import kernel_available  # noqa: E402

if kernel_available():
    # Define the kernels now, in the mode just set: a test that sets TRITON_INTERPRET=0 for the
    # PyTorch path would otherwise define them compiled if it were the first to import them.
    import aloe_kernels.ops  # noqa: E402, F401

DATA_DIR = Path(os.environ.get("ALOE_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm")


def _draw_on_cpu(fn):
    """Wrap a torch random factory: a CPU generator draws on CPU, then the result moves to the default device.

    Without a device or a CPU generator the default device is passed explicitly:
    ``torch.set_default_device`` recognises factories by identity, and once
    wrapped, ``torch.randn`` is no longer the function it knows.
    """

    @functools.wraps(fn)
    def wrapper(*args, generator=None, **kwargs):
        if kwargs.get("device") is None:
            if generator is not None and generator.device.type == "cpu":
                return fn(*args, generator=generator, device="cpu", **kwargs).to(torch.get_default_device())
            kwargs["device"] = torch.get_default_device()
        return fn(*args, generator=generator, **kwargs)

    return wrapper


def _use_test_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"ALOE_TEST_DEVICE={device} but torch.cuda.is_available() is False")
    torch.set_default_device(device)
    for name in _RANDOM_FACTORIES:
        setattr(torch, name, _draw_on_cpu(getattr(torch, name)))


if TEST_DEVICE != "cpu":
    _use_test_device(TEST_DEVICE)


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
    """Run a test through the CPU sparse path and through the Triton kernel (interpreter on CPU)."""
    if request.param == "sparse":
        if TEST_DEVICE != "cpu":
            pytest.skip("on CUDA tensors the dispatch always takes the fused kernel; the sparse path is CPU-only")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        from aloe_kernels.ops import kernel_available

        compiled = TEST_DEVICE != "cpu"
        if not kernel_available() or (not compiled and os.environ.get("TRITON_INTERPRET") != "1"):
            pytest.skip("the fused kernel needs Triton and TRITON_INTERPRET=1 set before start-up on CPU")
    return request.param


@pytest.fixture(scope="session")
def smollm2_encoder_cache(tmp_path_factory) -> Path:
    """One encoder cache for the real-SmolLM2 builds of a test run: those with the same stage-1 settings
    and corpus pools train the encoder and collect the pools once."""
    return tmp_path_factory.mktemp("smollm2-encoders")


# Fixtures that load SmolLM2-135M or build on it. A fixture cannot carry a marker, so every test
# that uses one is marked slow here; other slow tests carry @pytest.mark.slow themselves.
SMOLLM2_FIXTURE_PREFIX = "smollm2"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by markers
def pytest_collection_modifyitems(config, items):
    """Mark the users of a SmolLM2 fixture slow; skip the gpu tests where CUDA is missing."""
    cuda = None
    for item in items:
        if any(name.startswith(SMOLLM2_FIXTURE_PREFIX) for name in item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
