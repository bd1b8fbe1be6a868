"""pytest's configuration for every test: the tiers' hypothesis profiles, the fixtures (rng, device, backend,
poisoned prefill outputs) and the validation-layer checks. Helpers a test imports are in tests/support.py."""

import zlib

import numpy as np
import pytest
from hypothesis import settings

import pagedvk

# Outputs the library allocates itself (numpy in, numpy out) start as NaN too, as the tests' own outputs do.
import pagedvk.config
import pagedvk.runtime.array
import pagedvk.testing.reference
pagedvk.runtime.array.POISON_EMPTY = True


# -- tiers: the default run covers every op, cache type, layout, backend, kernel and variant and every rejected input;
# the rest of each matrix (every head size, block size, group width...) is marked `full` and runs with
# `pytest -m "full or not full"` (pyproject.toml deselects it by default). Which value goes where is said where
# the test is parametrized (support.tiered).

# Property tests draw fewer examples in the default tier: `--hypothesis-profile=full` draws the exhaustive tier's.
settings.register_profile("default-tier", max_examples=12, deadline=None)
settings.register_profile("full", max_examples=40, deadline=None)
settings.load_profile("default-tier")   # the plugin loads --hypothesis-profile's after this, where it is given


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test: seeded from the test's name.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def device():
    return pagedvk.default_device()


@pytest.fixture(params=("glsl", "wgsl"))
def backend(request):
    """The shader backend: a test that takes it runs on the GLSL modules and on their WGSL translations."""
    return request.param


@pytest.fixture
def poisoned_prefill_outputs(monkeypatch):
    """Every array prefill allocates for its results starts as a quiet NaN: an element a kernel never writes stays
    NaN and fails rel_error's finiteness check (or a comparison with zero). Modules take it with
    `pytestmark = pytest.mark.usefixtures("poisoned_prefill_outputs")` or a test by naming it."""
    def poisoned_empty(shape, dtype=np.float32, device=None):
        a = pagedvk.empty(shape, dtype, device)
        a.device.fill(a.buffer, 0x7FC00000)   # a float32 quiet NaN, as the 32-bit word vkCmdFillBuffer writes
        return a
    monkeypatch.setattr(pagedvk.ops.prefill, "empty", poisoned_empty)


# -- validation in CI: `PAGEDVK_VALIDATION=1 pytest` fails any test after which the layer said anything --

VALIDATING = pagedvk.config.validation()


def pytest_configure(config):
    config.addinivalue_line("markers", "provokes_validation: the test causes validation messages on purpose "
                                       "(and checks them itself); the validation fixture ignores them")


@pytest.fixture(autouse=True)
def no_validation_messages(request):
    """With PAGEDVK_VALIDATION=1, every message the layer reported during a test (warnings included, and
    synchronization validation's) fails that test, even where no device.check() raised it."""
    from pagedvk.runtime.instance import current_instance
    if VALIDATING and current_instance() is not None:
        current_instance().take_messages()   # anything left by a test that already failed, or its setup
    yield
    if not VALIDATING or current_instance() is None:
        return
    messages = current_instance().take_messages()
    if messages and request.node.get_closest_marker("provokes_validation") is None:
        pytest.fail(f"{len(messages)} Vulkan validation message(s) during this test:\n" + "\n\n".join(messages),
                    pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def no_validation_messages_at_close():
    """With PAGEDVK_VALIDATION=1, close the devices the tests opened before the session ends and fail
    on what the layer says then (objects destroyed while in use, say), which no test's teardown sees."""
    yield
    from pagedvk.runtime import selection
    from pagedvk.runtime.instance import current_instance
    if not VALIDATING or current_instance() is None:
        return
    for device in selection.open_devices():
        device.close()
    messages = current_instance().take_messages()
    if messages:
        pytest.fail(f"{len(messages)} Vulkan validation message(s) when the devices closed:\n" + "\n\n".join(messages),
                    pytrace=False)
