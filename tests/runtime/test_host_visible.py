"""Arrays in mapped host memory (pagedvk.empty(..., host_visible=True)): kernels read and write them as any device
array; the host writes and reads them in place, with no copy submitted; views keep the flag; one binding at most."""

import numpy as np
import pytest

import pagedvk
from pagedvk.runtime import array as array_module
from pagedvk.testing import reference
from support import rel_error


def test_kernels_read_and_write_host_visible_arrays(rng, device):
    table = rng.standard_normal((50, 24)).astype(np.float32)
    ids = np.array([3, 49, 0, 7], np.int32)
    ids_d = pagedvk.empty(4, np.int32, device, host_visible=True)
    out = pagedvk.empty((4, 24), np.float32, device, host_visible=True)   # poisoned (NaN) by the suite
    assert ids_d.host_visible and out.host_visible and not pagedvk.empty(4, np.int32, device).host_visible
    ids_d.write(ids)
    pagedvk.embedding(ids_d, pagedvk.asarray(table, device), out=out)
    np.testing.assert_array_equal(out.numpy(), table[ids])
    w = rng.standard_normal((10, 24)).astype(np.float16)
    y = pagedvk.linear(out, pagedvk.asarray(w, device), out=pagedvk.empty((4, 10), np.float32, device,
                                                                         host_visible=True))
    assert rel_error(y.numpy(), reference.linear(table[ids], w)) <= 1e-5


def test_writes_and_reads_submit_nothing(device, monkeypatch):
    a = pagedvk.empty((3, 8), np.int32, device, host_visible=True)
    submitted = []
    monkeypatch.setattr(type(device), "run_once", lambda *args, **kw: submitted.append(args))
    a.write(np.arange(24, dtype=np.int32).reshape(3, 8))
    a[1:, 2:6].write(np.full((2, 4), -1, np.int32))
    got = a.numpy()
    assert submitted == []
    want = np.arange(24, dtype=np.int32).reshape(3, 8)
    want[1:, 2:6] = -1
    np.testing.assert_array_equal(got, want)
    assert a[1:].host_visible and a.reshape(24).host_visible


def test_larger_than_a_binding_is_rejected(device, monkeypatch):
    monkeypatch.setattr(array_module, "segment_limit", lambda device: 64)
    with pytest.raises(ValueError, match=r"a host-visible array is one binding: shape \(5, 4\) \(int32\) is 80 bytes"):
        pagedvk.empty((5, 4), np.int32, device, host_visible=True)
    assert pagedvk.empty((5, 4), np.int32, device).buffers   # device-local arrays split into segments instead
