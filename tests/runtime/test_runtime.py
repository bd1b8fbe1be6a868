"""The Vulkan layer: devices and their selection, device arrays, timestamps, validation, close()."""

import os

import numpy as np
import pytest

import pagedvk
from support import PROBLEM, Case, program, rel_error, run_python
from pagedvk.runtime import selection
from pagedvk.runtime.instance import DeviceInfo


def test_devices_describe_each_device():
    infos = pagedvk.devices()
    assert infos, "no Vulkan device"
    for i, info in enumerate(infos):
        assert info.index == i and info.name
        assert info.type in ("discrete", "integrated", "virtual", "cpu", "other")
        assert info.subgroup_size >= 1 and info.max_storage_buffer_range > 0
        assert info.device_local_bytes > 0 and info.api_version.startswith("1.")
        for flag in ("fp16", "storage16", "storage8", "bf16", "cooperative_matrix"):
            assert isinstance(getattr(info, flag), bool)
        assert isinstance(info.compute_units, int) and info.compute_units >= 0


def test_compute_units_reported_or_estimated():
    from pagedvk.ops.decode_rules import UNITS_ESTIMATE, compute_units
    info = pagedvk.devices()[0]
    units = compute_units(info)
    assert units == (info.compute_units or (os.cpu_count() if info.type == "cpu" else UNITS_ESTIMATE[info.type]))
    assert units >= 1


def test_dedicated_allocations_hold_data(rng, monkeypatch):
    # Buffers past DEDICATED_MIN_BYTES get an allocation of their own (the allocation-history probe's
    # switch); the data goes in and out the same.
    from pagedvk.runtime import memory
    monkeypatch.setattr(memory, "DEDICATED_MIN_BYTES", 1 << 12)
    host = rng.standard_normal((64, 1024)).astype(np.float32)
    a = pagedvk.asarray(host)
    np.testing.assert_array_equal(a.numpy(), host)
    a.close()


def test_select_by_index_and_name(monkeypatch):
    first = pagedvk.devices()[0]
    monkeypatch.setenv("PAGEDVK_DEVICE", "0")
    assert pagedvk.select()[0] == first
    monkeypatch.setenv("PAGEDVK_DEVICE", first.name[2:9].upper())
    info, reason = pagedvk.select()
    assert info.name == first.name and "name match" in reason


def test_unmatched_device_lists_the_devices(monkeypatch):
    monkeypatch.setenv("PAGEDVK_DEVICE", "no-such-gpu-xyz")
    with pytest.raises(pagedvk.DeviceNotFoundError, match="no-such-gpu-xyz") as e:
        pagedvk.default_device()
    assert pagedvk.devices()[0].name in str(e.value)
    monkeypatch.setenv("PAGEDVK_DEVICE", "97")
    with pytest.raises(pagedvk.DeviceNotFoundError, match="no device with index 97"):
        pagedvk.select()


def fake(index, type_):
    return DeviceInfo(index=index, name=f"fake {type_} {index}", type=type_, vendor="x", driver="x",
                      driver_version="1", api_version="1.3.0", device_local_bytes=1, subgroup_size=32, fp16=False,
                      storage16=False, storage8=False, bf16=False, cooperative_matrix=False,
                      max_storage_buffer_range=1, max_allocation_bytes=1, min_storage_buffer_offset_alignment=16,
                      max_workgroup_count=(65535,) * 3, compute_units=0,
                      extensions=frozenset())


@pytest.mark.parametrize("types,expected", [
    (["cpu", "integrated", "discrete"], 2), (["cpu", "virtual"], 1), (["cpu", "integrated", "integrated"], 1),
    (["other", "cpu"], 1)])
def test_default_prefers_discrete_integrated_virtual_cpu(monkeypatch, types, expected):
    monkeypatch.delenv("PAGEDVK_DEVICE", raising=False)
    monkeypatch.setattr(selection, "devices", lambda: [fake(i, t) for i, t in enumerate(types)])
    assert selection.select()[0].index == expected


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint8])
def test_array_round_trip(rng, dtype, device):
    host = (rng.standard_normal((3, 5, 7)) * 50).astype(dtype)
    a = pagedvk.asarray(host)
    assert a.shape == (3, 5, 7) and a.dtype == np.dtype(dtype) and a.nbytes == host.nbytes
    assert a.device is device and a.ndim == 3 and a.size == host.size
    np.testing.assert_array_equal(a.numpy(), host)
    np.testing.assert_array_equal(np.asarray(a), host)
    a.close()
    a.close()   # idempotent
    with pytest.raises(pagedvk.ClosedError):
        a.numpy()


def test_empty_zeros_write(rng):
    z = pagedvk.zeros((4, 33), np.float16)
    assert (z.numpy() == 0).all()
    host = rng.standard_normal((4, 33)).astype(np.float16)
    z.write(host)
    np.testing.assert_array_equal(z.numpy(), host)
    with pytest.raises(ValueError, match="shape"):
        z.write(host[:2])
    e = pagedvk.empty(0, np.int32)
    assert e.numpy().shape == (0,)


def test_array_rejects_bad_dtype_and_shape():
    with pytest.raises(TypeError, match="float64 is not supported"):
        pagedvk.asarray(np.zeros(3))
    with pytest.raises(ValueError, match="shape must be non-negative"):
        pagedvk.empty((2, -1))


def test_rows_larger_than_one_binding_are_a_clear_error(device):
    # Arrays larger than one binding are split into segments of whole rows (tests/ops/test_large.py); a single row
    # larger than a binding cannot be.
    too_big = device.info.max_storage_buffer_range // 4 + 1
    with pytest.raises(ValueError, match=r"has \d+-byte rows, more than .* can bind or allocate at once"):
        pagedvk.empty((1, too_big), np.float32)


def test_timestamps_time_a_launch(rng):
    from support import Case
    case = Case(rng, seq_lens=[300, 200])
    q, k, v = (pagedvk.asarray(a) for a in case.args()[:3])
    out = pagedvk.empty(case.query.shape)
    with pagedvk.DecodePlan.for_caches(k, v, case.block_tables, case.seq_lens, num_heads=8) as plan:
        t = [plan.time_ns(q, k, v, out) for _ in range(3)]
    assert all(x > 0 for x in t)


def validation_available() -> bool:
    return any(os.path.exists(os.path.join(d, "VkLayer_khronos_validation.json"))
               for d in ("/usr/share/vulkan/explicit_layer.d", "/etc/vulkan/explicit_layer.d",
                         "/usr/local/share/vulkan/explicit_layer.d"))


def test_validation_messages_are_raised():
    if not validation_available():
        pytest.fail("VK_LAYER_KHRONOS_validation missing: install vulkan-validationlayers")
    # A barrier whose access mask does not fit its stage is invalid (and harmless to run): the layer
    # must report it and pagedvk must raise it after the call.
    result = run_python("""
        import vulkan as vk, pagedvk
        from pagedvk.runtime.commands import memory_barrier
        dev = pagedvk.default_device()
        cmd = dev.command_buffer()
        try:
            cmd.record(lambda c: memory_barrier(c, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, vk.VK_ACCESS_SHADER_WRITE_BIT,
                                                vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, vk.VK_ACCESS_SHADER_READ_BIT))
        except pagedvk.ValidationError as e:
            print("raised:", str(e)[:200])
        """, PAGEDVK_VALIDATION="1")
    assert "raised: Vulkan validation" in result.stdout, result.stdout + result.stderr


def test_validation_messages_name_the_objects():
    if not validation_available():
        pytest.fail("VK_LAYER_KHRONOS_validation missing: install vulkan-validationlayers")
    # With validation on, objects carry debug-utils names: a command buffer its op's, a pipeline (and its layout)
    # its module's variant name, a buffer what it holds and, once bound, its role. Each is provoked into a
    # message by a command that is recorded, never submitted.
    result = run_python("""
        import numpy as np, vulkan as vk, pagedvk
        from pagedvk.kernels import catalogue, modules
        dev = pagedvk.default_device()

        def message(name, record):
            cmd = dev.command_buffer(name)
            try:
                cmd.record(record)
            except pagedvk.ValidationError as e:
                return str(e)
            finally:
                cmd.close()
            return "no message"

        # A push of the wrong stage names the pipeline layout, which carries the module's name.
        p = modules.pipeline(dev, catalogue.PAGED_DECODE, catalogue.PAGED_DECODE.key("glsl", "f32", "f32"))
        data = vk.ffi.new("char[]", 4)
        print("push:", message("push probe", lambda c: vk.vkCmdPushConstants(
            c, p.layout, vk.VK_SHADER_STAGE_VERTEX_BIT, 0, 4, data)))
        # A fill past a buffer's end names the buffer: the cache's role in the decode it was bound in.
        rng = np.random.default_rng(1)
        k = pagedvk.asarray(rng.standard_normal((6, 2, 8, 16, 4)).astype(np.float32), device=dev)
        v = pagedvk.asarray(rng.standard_normal((6, 2, 32, 16)).astype(np.float32), device=dev)
        q = rng.standard_normal((2, 4, 32)).astype(np.float32)
        bt = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
        pagedvk.paged_attention(q, k, v, bt, np.array([40, 17], np.int32))
        buf = k.buffers[0]
        print("fill:", message("fill probe", lambda c: vk.vkCmdFillBuffer(c, buf.handle, 0, buf.size + 4, 0)))
        """, PAGEDVK_VALIDATION="1")
    out = result.stdout + result.stderr
    assert "name = push probe, type = VK_OBJECT_TYPE_COMMAND_BUFFER" in out, out
    assert "VkPipelineLayout 0x" in out and "[paged_decode.kv_f32.glsl]" in out, out
    assert "name = key_cache of paged_decode" in out and "array (6, 2, 8, 16, 4) float32, type = VK_OBJECT_TYPE_BUFFER" in out, out


def test_object_names_cost_nothing_without_validation():
    # Without validation nothing is named: no name is built, vkSetDebugUtilsObjectNameEXT is never looked up. In a
    # process of its own, validation off, as CI's second pass runs the suite with PAGEDVK_VALIDATION=1.
    result = run_python("""
        import numpy as np, pagedvk
        dev = pagedvk.default_device()
        assert not dev.instance.validation and not dev.debug_names and dev.object_namer is None
        a = pagedvk.asarray(np.arange(4, dtype=np.float32), device=dev)
        assert a.buffers[0].name is None
        print("ok")
    """, PAGEDVK_VALIDATION="")
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_decode_is_clean_under_validation():
    if not validation_available():
        pytest.fail("VK_LAYER_KHRONOS_validation missing: install vulkan-validationlayers")
    result = run_python(program(PROBLEM, """
        assert right(attend())
        pagedvk.default_device().close()
        pagedvk.default_device().instance.raise_validation_messages()
        print("clean")
        """), PAGEDVK_VALIDATION="1")
    assert result.returncode == 0 and "clean" in result.stdout, result.stdout + result.stderr


def test_device_close_is_idempotent_and_final():
    info = pagedvk.devices()[0]
    dev = pagedvk.Device(info)
    a = pagedvk.asarray(np.arange(10, dtype=np.int32), device=dev)
    assert dev.live_objects() >= 1
    dev.close()
    dev.close()
    with pytest.raises(pagedvk.ClosedError):
        pagedvk.empty(4, device=dev)
    assert a.closed


def test_dropped_objects_are_freed(rng, device):
    import gc
    from support import Case
    case = Case(rng)
    pagedvk.paged_attention(*case.args())   # the pipeline is made once and kept by the device
    gc.collect()
    before = device.live_objects()
    arrays = [pagedvk.asarray(rng.standard_normal(100).astype(np.float32)) for _ in range(20)]
    assert device.live_objects() == before + 20
    del arrays
    gc.collect()
    assert device.live_objects() == before
    for _ in range(5):
        pagedvk.paged_attention(*case.args())   # plans, launches and temporaries all go
    gc.collect()
    assert device.live_objects() == before


def test_owned_objects_share_close_and_with(device):
    from pagedvk.runtime.commands import CommandBuffer
    from pagedvk.runtime.memory import Buffer
    from pagedvk.runtime.owned import Owned
    from pagedvk.runtime.pipeline import DescriptorSet, Launch, Pipeline
    for cls in (Buffer, CommandBuffer, Pipeline, DescriptorSet, Launch, pagedvk.DeviceArray, pagedvk.DecodePlan,
                pagedvk.Device):
        assert issubclass(cls, Owned), cls
    live = device.live_objects()
    with device.buffer(64) as b, device.command_buffer() as cmd, pagedvk.zeros(4) as a:
        assert not (b.closed or cmd.closed or a.closed)
        assert b.uid != device.buffer(64).uid   # never reused, unlike id()
    assert b.closed and cmd.closed and a.closed
    b.close()   # twice is fine
    import gc
    gc.collect()
    assert device.live_objects() == live


# -- buffer ranges: arrays over sub-ranges of one buffer (the tests' sentinels sit in the same buffer) --

def test_arrays_over_ranges_of_one_buffer(rng, device):
    from pagedvk.runtime.array import DeviceArray
    from pagedvk.ops.layouts import bind_caches
    buffer = device.buffer(4096)
    device.fill(buffer, 0x7F7F7F7F)
    a_host, b_host = rng.standard_normal(10).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    a = DeviceArray.over_buffer(buffer, 1024, a_host.shape, np.float32).write(a_host)
    b = DeviceArray.over_buffer(buffer, 2048, b_host.shape, np.float32).write(b_host)
    assert (a.buffer.size, a.buffer.offset) == (48, 1024)   # its own range, rounded up to 16 bytes
    np.testing.assert_array_equal(a.numpy(), a_host)
    np.testing.assert_array_equal(b.numpy(), b_host)
    device.fill(b.buffer, 0)
    whole = device.download(buffer).view(np.float32)
    np.testing.assert_array_equal(whole[256:266], a_host)
    assert (whole[512:576] == 0).all()
    untouched = np.ones(1024, bool)
    untouched[256:266] = untouched[512:576] = False
    assert (whole[untouched].view(np.uint32) == 0x7F7F7F7F).all()   # nothing written outside the ranges
    # What a kernel bounds block ids by is the range, not the buffer.
    assert bind_caches(a, b, "glsl").key_bytes == 48
    del buffer   # the arrays keep it alive; closing one frees nothing the other uses
    a.close()
    assert a.closed and not b.closed
    np.testing.assert_array_equal(b.numpy(), 0)
    b.close()


def test_buffer_range_offsets_are_checked(device):
    from pagedvk.runtime.array import DeviceArray
    from pagedvk.runtime.memory import BufferRange
    buffer = device.buffer(256)
    with pytest.raises(ValueError, match=r"offset must be a multiple of 4 in \[0, 240\] .* got 248"):
        BufferRange(buffer, 248, 16)
    with pytest.raises(ValueError, match="offset must be a multiple of 4"):
        BufferRange(buffer, 6, 16)
    # A kernel binding must start at minStorageBufferOffsetAlignment: refused before anything is bound.
    align = device.info.min_storage_buffer_offset_alignment
    case = Case(np.random.default_rng(0), num_seqs=1, head_size=32, max_len=20)
    q = DeviceArray.over_buffer(device.buffer(case.query.nbytes + 2 * align), align // 2 // 4 * 4 or align,
                          case.query.shape, np.float32).write(case.query)
    if q.buffer.offset % align:   # a device that takes any multiple of 4 has nothing to refuse
        with pytest.raises(ValueError, match=rf"must start at a multiple of {align} bytes "
                                             r"\(minStorageBufferOffsetAlignment"):
            pagedvk.paged_attention(q, *case.args()[1:])
    q = DeviceArray.over_buffer(q.buffer.buffer, align, case.query.shape, np.float32).write(case.query)
    assert rel_error(pagedvk.paged_attention(q, *case.args()[1:]).numpy(), case.reference()) < 1e-5


def test_cooperative_matrices_stay_off_under_a_validation_layer_that_predates_them():
    # Debian 12's layer (1.3.239) reports VK_KHR_cooperative_matrix's structures at device creation as invalid:
    # under it the device leaves the extension off. Its first header was 1.3.255.
    from pagedvk.runtime.instance import layer_knows_cooperative_matrix
    version = lambda patch: (1 << 22) | (3 << 12) | patch
    assert not layer_knows_cooperative_matrix(version(239))
    assert not layer_knows_cooperative_matrix(version(254))
    assert layer_knows_cooperative_matrix(version(255))
    assert layer_knows_cooperative_matrix((1 << 22) | (4 << 12) | 0)


def test_a_launch_checks_its_bindings_again_after_any_close(device):
    # Launch.submit skips re-reading every binding's `closed` while nothing was closed since its last check
    # (owned.closes()); a closed range, a closed buffer and a collected one must each still be refused.
    import gc
    from pagedvk.runtime.memory import BufferRange
    from pagedvk.runtime.pipeline import Launch
    from pagedvk.kernels import modules
    from pagedvk.kernels.catalogue import READ_BANDWIDTH
    pipeline = modules.pipeline(device, READ_BANDWIDTH, READ_BANDWIDTH.key("glsl"))
    for how in ("range", "buffer", "collected"):
        src, dst = pagedvk.zeros(64, np.uint32, device=device), pagedvk.zeros(256, np.uint32, device=device)
        bound = BufferRange(src.buffer, 0, 256) if how == "range" else src.buffer
        launch = Launch(device, [(pipeline, (bound, dst.buffer), READ_BANDWIDTH.pack_push(num_chunks=16), (1, 1, 1))])
        launch.submit()
        launch.submit()   # nothing closed in between: no check made
        if how == "range":
            bound.close()
        elif how == "buffer":
            src.close()
        else:
            del bound, src   # no reference left: the buffer is collected, and its weak reference dies
            gc.collect()
        with pytest.raises(pagedvk.ClosedError):
            launch.submit()
        launch.close()
        dst.close()
