"""DeviceArray views (issue 38, "strided inputs"): basic slicing and reshape give views of the same device memory,
rows of the first axis at a fixed pitch, each row contiguous, as numpy gives them; numpy() and write() of a view
reach only its own elements; everything a view cannot represent is refused with an error naming what is wrong."""

import numpy as np
import pytest

import pagedvk
from pagedvk.runtime import array

T, H, KV, D = 5, 4, 2, 16
WIDTH = (H + 2 * KV) * D


@pytest.fixture
def fused(rng, device):
    """A fused QKV projection's output, on the host and on the device."""
    host = rng.standard_normal((T, WIDTH)).astype(np.float32)
    return host, pagedvk.asarray(host, device)


def test_slices_and_reshapes_read_like_numpy(fused):
    host, qkv = fused
    cases = {
        "q": (qkv[:, :H * D].reshape(T, H, D), host[:, :H * D].reshape(T, H, D)),
        "k": (qkv[:, H * D:(H + KV) * D].reshape(T, KV, D), host[:, H * D:(H + KV) * D].reshape(T, KV, D)),
        "v": (qkv[:, (H + KV) * D:].reshape(T, -1, D), host[:, (H + KV) * D:].reshape(T, -1, D)),
        "rows": (qkv[1:4], host[1:4]),
        "row": (qkv[2], host[2]),
        "negative row": (qkv[-1], host[-1]),
        "ellipsis": (qkv[..., 4:12], host[..., 4:12]),
        "a column (rows of one element)": (qkv[:, 1], host[:, 1]),
        "rows of a view": (qkv[:, :H * D].reshape(T, H, D)[1:3], host[1:3, :H * D].reshape(2, H, D)),
        "heads 1-2 (a middle axis, one run a row)": (qkv[:, :H * D].reshape(T, H, D)[:, 1:3],
                                                     host[:, :H * D].reshape(T, H, D)[:, 1:3]),
        "one head of one token": (qkv[:, :H * D].reshape(T, H, D)[3, 1], host[3, D:2 * D]),
        "contiguous reshape": (qkv.reshape(-1, D), host.reshape(-1, D)),
        "empty": (qkv[2:2], host[2:2]),
    }
    for name, (view, expected) in cases.items():
        assert view.shape == expected.shape, name
        assert view.base is qkv, name
        np.testing.assert_array_equal(view.numpy(), expected, err_msg=name)
        assert view.strides == expected.strides or expected.size == 0, name
        assert view.is_contiguous == expected.flags.c_contiguous, name


def test_strides_pitch_offset_and_flags(fused):
    _, qkv = fused
    q = qkv[:, :H * D].reshape(T, H, D)
    k = qkv[:, H * D:(H + KV) * D].reshape(T, KV, D)
    assert (q.pitch, q.offset, q.strides) == (WIDTH, 0, (WIDTH * 4, D * 4, 4))
    assert (k.pitch, k.offset) == (WIDTH, H * D * 4)
    assert not q.is_contiguous and not q.flags["c_contiguous"] and q.flags["view"] and not q.flags["owndata"]
    assert qkv.flags == {"c_contiguous": True, "owndata": True, "view": False}
    assert (qkv.base, qkv.offset, qkv.pitch, qkv.strides) == (None, 0, WIDTH, (WIDTH * 4, 4))
    assert qkv[1:3].is_contiguous and qkv[1:3].offset == WIDTH * 4
    assert "view at byte" in repr(k)
    # A view binds its own range of its base's buffer: the kernels see only its bytes.
    assert k.buffer.offset == H * D * 4 and k.buffer.nbytes == ((T - 1) * WIDTH + KV * D) * 4


def test_write_reaches_only_the_views_elements(fused):
    host, qkv = fused
    k = qkv[:, H * D:(H + KV) * D].reshape(T, KV, D)
    k.write(np.full((T, KV, D), -7.0, np.float32))
    expected = host.copy()
    expected[:, H * D:(H + KV) * D] = -7.0
    np.testing.assert_array_equal(qkv.numpy(), expected)
    qkv[1:2].write(np.zeros((1, WIDTH), np.float32))   # a contiguous view: one copy
    expected[1] = 0
    np.testing.assert_array_equal(qkv.numpy(), expected)
    with pytest.raises(ValueError, match="shape"):
        k.write(np.zeros((T, KV * D), np.float32))


def test_views_of_the_same_bytes_share_one_range(fused):
    # An engine slices its projection anew every step: the same range (one buffer uid) keeps recorded launches valid.
    _, qkv = fused
    a, b = qkv[:, :H * D], qkv[:, :H * D].reshape(T, H, D)
    assert a.buffer is b.buffer
    assert qkv[:, H * D:].buffer is not a.buffer


def test_view_lifetime(fused):
    host, qkv = fused
    q = qkv[:, :H * D]
    q.close()   # ends the view's own use only
    assert q.closed and not qkv.closed
    with pytest.raises(pagedvk.ClosedError):
        q.numpy()
    np.testing.assert_array_equal(qkv.numpy(), host)
    k = qkv[:, H * D:]
    qkv.close()   # the base's memory is freed: its views are closed with it
    assert k.closed
    with pytest.raises(pagedvk.ClosedError):
        k.numpy()


def test_view_keeps_its_base_alive(rng, device):
    host = rng.standard_normal((T, WIDTH)).astype(np.float32)
    q = pagedvk.asarray(host, device)[:, :H * D]   # the base is referenced by the view only
    import gc
    gc.collect()
    np.testing.assert_array_equal(q.numpy(), host[:, :H * D])


@pytest.mark.parametrize("index, error, match", [
    ((slice(None), slice(None, None, 2)), ValueError, "axis 1 has step 2"),
    ((slice(None, None, -1),), ValueError, "axis 0 has step -1"),
    ((None,), TypeError, "basic slicing only"),
    (([0, 2],), TypeError, "basic slicing only"),
    ((0, 0, 0), IndexError, "too many indices"),
    ((T,), IndexError, "out of bounds for axis 0"),
    ((Ellipsis, Ellipsis), IndexError, "single ellipsis"),
])
def test_unrepresentable_slices_are_refused(fused, index, error, match):
    _, qkv = fused
    with pytest.raises(error, match=match):
        qkv[index]


def test_rows_that_are_not_contiguous_are_refused(fused):
    _, qkv = fused
    q = qkv[:, :H * D].reshape(T, H, D)
    with pytest.raises(ValueError, match=r"axis 1 would step 16 elements where a contiguous row steps 2"):
        q[:, :, :2]   # every head's first two dims: H runs a row
    with pytest.raises(ValueError, match="need a copy"):
        q.reshape(T * H, D)   # rows apart cannot merge with the axis inside them
    with pytest.raises(ValueError, match="need a copy"):
        qkv[:, :H * D].reshape(-1)
    with pytest.raises(ValueError, match="cannot take shape"):
        qkv.reshape(3, 7)
    with pytest.raises(ValueError, match="at most one dimension may be -1"):
        qkv.reshape(-1, -1)


def test_view_must_start_on_a_word(device):
    a = pagedvk.asarray(np.zeros((4, 8), np.float16), device)
    with pytest.raises(ValueError, match="starts at byte 2 of its buffer, not a multiple of 4"):
        a[:, 1:]
    assert a[:, 2:].offset == 4


def test_segmented_arrays_have_no_views(device, monkeypatch):
    monkeypatch.setattr(array, "segment_limit", lambda device: 4096)
    a = pagedvk.zeros((8, 1024), np.float32, device)   # 4 KiB rows: one buffer each
    assert len(a.buffers) == 8
    with pytest.raises(ValueError, match="arrays split into segments have no views"):
        a[:, :16]
    with pytest.raises(ValueError, match="arrays split into segments have no views"):
        a.reshape(16, 512)
