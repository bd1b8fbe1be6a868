"""Objects that own device arrays, closed or dropped while (or after) they are used: every run either
returns the right answer or raises ClosedError, and recorded launches keep nothing alive."""

import gc
import threading
import weakref

import pytest

import pagedvk
from support import JOIN_S, Case, rel_error
from pagedvk.runtime import pipeline

def plan_for(case, **kw):
    return pagedvk.DecodePlan(case.block_tables, case.seq_lens, num_heads=case.query.shape[1],
                              num_kv_heads=case.key_cache.shape[1], head_size=case.query.shape[2],
                              block_size=case.key_cache.shape[3], num_blocks=case.key_cache.shape[0], **kw)


def start(target):
    """Run target in a thread; returns (thread, outcome) where outcome gets 'value' or 'error'."""
    outcome = {}

    def body():
        try:
            outcome["value"] = target()
        except BaseException as e:   # noqa: BLE001 - handed to the test thread
            outcome["error"] = e
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def joined(thread):
    thread.join(JOIN_S)
    assert not thread.is_alive(), f"thread still running after {JOIN_S} s"


def test_close_racing_run_never_gives_a_wrong_answer(rng, device, monkeypatch):
    # Deterministic interleaving: close() pauses after taking the plan lock (inside freeing the plan's
    # own arrays); run() pauses just before recording. Before the fix close freed the arrays after
    # releasing the lock, and the run bound freed buffers (zeros, or a crash under validation).
    case = Case(rng, num_seqs=2, head_size=32, max_len=100)
    plan = plan_for(case)
    q, k, v = (pagedvk.asarray(a) for a in case.args()[:3])
    close_paused, resume_close, closed = threading.Event(), threading.Event(), threading.Event()
    owned_close = plan.seq_lens.close

    def paused_close():
        close_paused.set()
        resume_close.wait(JOIN_S)
        owned_close()
    monkeypatch.setattr(plan.seq_lens, "close", paused_close)
    steps = plan.steps

    def paused_steps(*a):
        closed.wait(JOIN_S)   # recording only once close() has finished
        return steps(*a)
    monkeypatch.setattr(plan, "steps", paused_steps)

    closer, _ = start(plan.close)
    assert close_paused.wait(JOIN_S)
    runner, outcome = start(lambda: plan.run(q, k, v).numpy())
    runner.join(0.5)            # the run gets as far as it can while close() is paused
    resume_close.set()
    joined(closer)
    closed.set()
    joined(runner)
    if "error" in outcome:
        assert isinstance(outcome["error"], pagedvk.ClosedError), outcome["error"]
        assert "DecodePlan(" in str(outcome["error"]), outcome["error"]
    else:
        assert rel_error(outcome["value"], case.reference()) < 1e-5
    for a in (q, k, v):
        a.close()


def test_array_closed_while_a_launch_is_recorded(rng, device, monkeypatch):
    # The key cache is closed by another thread between the moment run() took its buffer and the
    # descriptor writes. Before the fix the buffer was freed under the launch (a null binding: zeros).
    case = Case(rng, num_seqs=2, head_size=32, max_len=100)
    plan = plan_for(case)
    q, k, v = (pagedvk.asarray(a) for a in case.args()[:3])
    plan.run(q, k, v).close()   # pipelines made, so only the launch is left to record
    make_set = pipeline.Pipeline.descriptor_set
    closers = []

    def closing_then_make(self, buffers):
        if not closers:
            closers.append(start(k.close)[0])
            closers[0].join(0.5)    # finishes at once unless the launch holds the buffers safe
        return make_set(self, buffers)
    monkeypatch.setattr(pipeline.Pipeline, "descriptor_set", closing_then_make)
    try:
        out = plan.run(q, k, v)
    except pagedvk.ClosedError:
        pass
    else:
        assert rel_error(out.numpy(), case.reference()) < 1e-5
        out.close()
    joined(closers[0])
    assert k.closed
    with pytest.raises(pagedvk.ClosedError):
        plan.run(q, k, v)
    plan.close()
    for a in (q, v):
        a.close()


def test_run_after_close_names_the_plan(rng, device):
    case = Case(rng, num_seqs=1, head_size=32, max_len=20)
    plan = plan_for(case)
    plan.close()
    plan.close()   # twice is fine
    with pytest.raises(pagedvk.ClosedError, match=r"DecodePlan\(num_seqs=1.* is closed"):
        plan.run(*case.args()[:3])


def test_recorded_launches_do_not_keep_dropped_caches_alive(rng, device):
    # One plan over many freshly uploaded caches, each dropped after its run: before the fix the plan's
    # recorded launches held every buffer (up to 32 sets) until plan.close().
    case = Case(rng, num_seqs=2, head_size=32, max_len=100)
    plan = plan_for(case)
    q = pagedvk.asarray(case.query)
    out = pagedvk.empty(case.query.shape)
    refs = []
    for _ in range(6):
        k, v = pagedvk.asarray(case.key_cache), pagedvk.asarray(case.value_cache)
        plan.run(q, k, v, out)
        refs += [weakref.ref(b) for b in k.buffers + v.buffers]
        del k, v
    gc.collect()
    assert all(r() is None for r in refs), f"{sum(r() is not None for r in refs)} dropped cache buffers kept alive"
    assert rel_error(out.numpy(), case.reference()) < 1e-5
    live = device.live_objects()
    k, v = pagedvk.asarray(case.key_cache), pagedvk.asarray(case.value_cache)
    plan.run(q, k, v, out)   # a stale launch is recorded again, not submitted
    assert rel_error(out.numpy(), case.reference()) < 1e-5
    del k, v
    gc.collect()
    assert device.live_objects() <= live + 2   # the new launch's command buffer and descriptor set
    plan.close()
    q.close()
    out.close()
