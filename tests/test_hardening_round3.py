"""Hardening found by trying the library as an adversarial user and against the peers' own suites (2026-12-03):
crashes, silent wrong answers, waits without a limit, late errors. docs/RELIABILITY.md lists each case with the
test that shows it. The crash tests run the crashing program many times, in subprocesses where the crash was
one of the process (exit, a bad variable)."""

import textwrap
import time

import numpy as np
import pytest
import vulkan as vk

import pagedvk
from conftest import Case, run_python
from pagedvk.errors import GPUTimeoutError

# A small decode problem every subprocess below runs: the device, its pipeline and objects exist before the
# part under test.
PROBLEM = """
    import numpy as np, pagedvk
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, 2, 8, 16, 4)).astype(np.float32)
    v = rng.standard_normal((6, 2, 32, 16)).astype(np.float32)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    bt = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    sl = np.array([40, 17], np.int32)
    def attend():
        return pagedvk.paged_attention(q, k, v, bt, sl)
    def right(out):
        ref = pagedvk.reference.paged_attention(q, k, v, bt, sl)
        return np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
"""


def program(*parts) -> str:
    """One program from parts each indented its own way."""
    return "\n".join(textwrap.dedent(p) for p in parts)


def passed(result, marker="ok") -> bool:
    return result.returncode == 0 and marker in result.stdout


# -- 1. crashes ----------------------------------------------------------------------------------------------


def test_device_close_racing_allocation_never_aborts():
    # Buffer.__init__ checked that the device was open without holding anything close() takes: a close between
    # the check and vkCreateBuffer / vkAllocateMemory / vkBindBufferMemory / vkMapMemory aborted the process
    # (8 of 12 runs). Now allocation and close exclude each other (Device.creating): every allocation either
    # finishes before the device goes, or raises ClosedError. 100 devices, each closed under 4 allocating threads.
    result = run_python("""
        import threading, time, numpy as np, pagedvk
        info = pagedvk.select()[0]
        for it in range(100):
            dev = pagedvk.Device(info)
            def alloc(i):
                try:
                    while True:
                        a = pagedvk.empty((256 * (i + 1),), np.float32, dev)
                        if i == 0:   # uploads and downloads race the close too
                            a.write(np.ones(a.shape, np.float32))
                            assert (a.numpy() == 1).all()
                        a.close()
                except pagedvk.ClosedError:
                    pass
            threads = [threading.Thread(target=alloc, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            time.sleep(0.002 * (it % 4))
            dev.close()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "a thread hung"
            assert dev.closed and dev.live_objects() == 0
        print("ok")
        """)
    assert passed(result), (result.returncode, result.stdout + result.stderr[-3000:])


def test_exit_with_daemon_threads_mid_call():
    # Exiting while daemon threads still ran ops segfaulted or aborted (6 of 8 runs of this program): the exit
    # hook destroyed the device under their allocations and pipelines. Eight exits, six threads each, allocating
    # (device queries, plans of their own) or not (numpy calls served by a kept plan), at different moments.
    code = program(PROBLEM, """
    import sys, threading, time
    attend()
    def loop(i):
        try:
            while True:
                if i % 3 == 0:
                    pagedvk.paged_attention(pagedvk.asarray(q), k, v, bt, sl).close()
                elif i % 3 == 1:
                    attend()
                else:
                    pagedvk.empty((4096,), np.float32).close()
        except pagedvk.ClosedError:
            pass   # the device, or pagedvk, closed at exit
    for i in range(6):
        threading.Thread(target=loop, args=(i,), daemon=True).start()
    time.sleep(float(sys.argv[1]))
    print("exiting")
    """)
    for run in range(8):
        result = run_python(code, [str(0.1 * (run + 1))])
        assert passed(result, "exiting"), (run, result.returncode, result.stderr[-3000:])


@pytest.mark.parametrize("value", ["abc", "nan", "2e6", "9" * 30])
def test_bad_spin_refused_at_startup(value):
    # PAGEDVK_SPIN_US was read inside the wait, after the submission: a bad value raised with the work running
    # untracked, and freeing its command buffer (a new pipeline's first dispatch, say) segfaulted. It is parsed
    # with the other variables, before a device opens; changed while running, it is refused before a
    # submission, and the process goes on. Each head size below makes a new pipeline.
    result = run_python(program(PROBLEM, f"""
    import os
    from pagedvk import selection
    try:
        pagedvk.zeros(4)
    except ValueError as e:
        assert not selection._open, "a device was opened first"
        print("refused at start-up:", e)
    os.environ["PAGEDVK_SPIN_US"] = "0"
    assert right(attend())
    os.environ["PAGEDVK_SPIN_US"] = {value!r}
    for h in (16, 48, 64, 80, 96, 128):
        kh = rng.standard_normal((6, 2, h // 4, 16, 4)).astype(np.float32)
        vh = rng.standard_normal((6, 2, h, 16)).astype(np.float32)
        qh = rng.standard_normal((2, 4, h)).astype(np.float32)
        try:
            pagedvk.paged_attention(qh, kh, vh, bt, sl)
        except ValueError as e:
            assert "PAGEDVK_SPIN_US" in str(e), e
        else:
            raise AssertionError("accepted")
    os.environ["PAGEDVK_SPIN_US"] = "10"
    assert right(attend())
    print("ok")
    """), PAGEDVK_SPIN_US=value)
    assert passed(result), (result.returncode, result.stdout + result.stderr[-3000:])
    assert "refused at start-up: PAGEDVK_SPIN_US must be a number of microseconds" in result.stdout


def test_bad_spv_dir_refused_at_startup(tmp_path):
    result = run_python("""
        import pagedvk
        try:
            pagedvk.zeros(4)
        except ValueError as e:
            print("refused:", e)
        """, PAGEDVK_SPV_DIR=str(tmp_path / "missing"))
    assert passed(result, "refused: PAGEDVK_SPV_DIR must be a folder"), result.stdout + result.stderr


def validation_layer_installed() -> bool:
    return any(layer.layerName == "VK_LAYER_KHRONOS_validation" for layer in vk.vkEnumerateInstanceLayerProperties())


@pytest.mark.skipif(not validation_layer_installed(), reason="needs the Khronos validation layer")
def test_exit_destroys_every_object_before_its_device():
    # Python's weakref.finalize exit hook ran before pagedvk's, after which the finalizers Device.close() called
    # did nothing: one paged_attention call then exit gave 29 x VUID-vkDestroyDevice-device-00378. close()
    # destroys each object itself now. The layer loaded by VK_INSTANCE_LAYERS prints what it finds to stdout.
    for run in range(3):
        result = run_python(program(PROBLEM, """
        assert right(attend())
        print("ok")
        """), VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation")
        output = result.stdout + result.stderr
        assert passed(result) and "VUID" not in output and "Validation Error" not in output, output[-3000:]
    # pagedvk's own handler (PAGEDVK_VALIDATION=1) hears nothing at exit either: an exit hook registered before
    # pagedvk's runs after it and counts what the handler recorded.
    result = run_python(program("""
        import atexit
        heard = []
        atexit.register(lambda: print("messages at exit:", len(heard[0].messages)))
        """, PROBLEM, """
        from pagedvk.runtime import instance
        heard.append(instance.get_instance())
        assert right(attend())
        """), PAGEDVK_VALIDATION="1")
    assert "messages at exit: 0" in result.stdout, result.stdout + result.stderr[-3000:]


# -- 3. waits and sizes --------------------------------------------------------------------------------------


def test_close_after_a_timeout_waits_with_a_limit(rng, monkeypatch):
    # close() called vkDeviceWaitIdle, which has no limit (5-19 s after PAGEDVK_TIMEOUT=1 here; forever on a hung
    # GPU). It waits on the timed-out submissions' fences, up to PAGEDVK_TIMEOUT, and then destroys everything.
    dev = pagedvk.Device(pagedvk.select()[0])
    case = Case(rng, num_seqs=4, num_heads=8, num_kv_heads=2, head_size=128, block_size=32, seq_lens=[2048] * 4)
    q, k, v = (pagedvk.asarray(a, device=dev) for a in (case.query, case.key_cache, case.value_cache))
    monkeypatch.setenv("PAGEDVK_TIMEOUT", "1e-9")
    with pytest.raises(GPUTimeoutError):
        pagedvk.paged_attention(q, k, v, case.block_tables, case.seq_lens)
    monkeypatch.setenv("PAGEDVK_TIMEOUT", "30")

    def unbounded(*args):
        raise AssertionError("vkDeviceWaitIdle has no limit")

    monkeypatch.setattr(vk, "vkDeviceWaitIdle", unbounded)
    dev.close()
    assert dev.closed and dev.live_objects() == 0 and not dev.abandoned and q.closed


HUNG_GPU = """
    import os, time, vulkan as vk
    from pagedvk.runtime import commands
    # A GPU that never finishes: every fence wait times out (after its limit), every fence reads not ready,
    # vkDeviceWaitIdle never returns.
    commands.wait_for_fences = lambda *args: vk.VK_TIMEOUT
    commands.get_fence_status = lambda *args: vk.VK_NOT_READY
    def not_ready(*args):
        raise vk.VkNotReady()
    vk.vkGetFenceStatus = not_ready
    def wait_for_fences(device, count, fences, wait_all, timeout):
        time.sleep(timeout / 1e9)
        raise vk.VkTimeout()
    vk.vkWaitForFences = wait_for_fences
    vk.vkDeviceWaitIdle = lambda device: time.sleep(3600)
    try:
        attend()
    except pagedvk.GPUTimeoutError:
        print("timed out")
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_close_and_exit_on_a_hung_gpu_return(how):
    # On a GPU that never finishes, close() and the exit gave up after PAGEDVK_TIMEOUT: the device is closed,
    # its objects left to the end of the process (never destroyed under running work), and the instance kept
    # for it. Before, both called vkDeviceWaitIdle: this program never ended.
    close = """
    dev = pagedvk.default_device()
    start = time.perf_counter()
    try:
        dev.close()
    except pagedvk.GPUTimeoutError as e:
        print("close gave up after", round(time.perf_counter() - start), "s:", e)
    assert dev.closed and dev.abandoned
    """
    started = time.perf_counter()
    result = run_python(program(PROBLEM, HUNG_GPU, close if how == "close" else ""), PAGEDVK_TIMEOUT="1")
    assert result.returncode == 0 and "timed out" in result.stdout, result.stdout + result.stderr[-3000:]
    if how == "close":
        assert "close gave up after 1 s: " in result.stdout and "left to the end of the process" in result.stdout
    else:
        assert "pagedvk: at exit: " in result.stderr and "left to the end of the process" in result.stderr
    assert time.perf_counter() - started < 30
