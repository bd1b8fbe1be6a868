"""The WGSL modules: sources that declare what pagedvk/abi.py declares, the naming of per-variant sources,
and backend="wgsl" running them (the numbers are checked per op in test_decode, test_prefill and
test_backward, on both backends)."""

import re
from pathlib import Path

import numpy as np
import pytest

import pagedvk
from pagedvk import abi
from conftest import rel_error
from test_prefill import PrefillCase, modules_used

SHADERS = Path(__file__).resolve().parent.parent / "shaders"
WGSL_KERNELS = [k for k in abi.KERNELS if "wgsl" in k.backends]


def source(kernel):
    """The module's WGSL with what it includes (`//!include`, pasted in by build_shaders.py)."""
    return "".join(p.read_text() for p in abi.source_files(SHADERS, kernel, "wgsl", kernel.variants[0]))


def test_every_attention_op_has_a_wgsl_module():
    assert {k.op for k in WGSL_KERNELS} >= {"paged_decode", "paged_prefill", "paged_backward_dq",
                                            "paged_backward_dkdv"}


@pytest.mark.parametrize("kernel", WGSL_KERNELS, ids=lambda k: k.op)
def test_push_constant_struct_is_the_declared_one(kernel):
    # Reflection sees offsets only (and naga wraps the struct in another); names and types are checked here.
    text = source(kernel)
    body = re.search(r"struct Params \{(.*?)\}", text, re.S).group(1)
    fields = re.findall(r"(\w+)\s*:\s*(\w+)\s*,", body)
    assert fields == [(f.name, f.kind) for f in kernel.push]
    assert re.search(r"^var<immediate> pc: Params;$", text, re.M)
    assert "enable subgroups" not in text


@pytest.mark.parametrize("kernel", WGSL_KERNELS, ids=lambda k: k.op)
def test_bindings_are_the_declared_ones(kernel):
    found = re.findall(r"@group\(0\) @binding\((\d+)\) var<storage, (read|read_write)> (\w+):", source(kernel))
    assert [(int(i), access, name) for i, access, name in found] == [
        (i, "read" if b.readonly else "read_write", b.name) for i, b in enumerate(kernel.bindings)]
    assert f"@workgroup_size({', '.join(map(str, kernel.workgroup_size))})" in source(kernel)


def test_variant_sources_are_named_per_variant():
    # WGSL has no preprocessor: the first variant is {op}.wgsl, any other its own {op}.{variant}.wgsl.
    kernel = abi.KernelABI(op="k", bindings=(), push=(), workgroup_size=(1, 1, 1),
                           variants=(abi.Variant("f32", {"KV_F32": 1}), abi.Variant("f16", {"KV_F16": 1})),
                           backends=("glsl", "wgsl"))
    assert [abi.source_name(kernel, b, v) for b in ("glsl", "wgsl") for v in kernel.variants] == [
        "k.comp", "k.comp", "k.wgsl", "k.f16.wgsl"]


def test_backend_argument_picks_the_wgsl_modules(rng, monkeypatch):
    used = modules_used(monkeypatch)
    case = PrefillCase(rng, q_len=3)
    dout = rng.standard_normal(case.query.shape).astype(np.float32)
    results = {}
    for backend in ("glsl", "wgsl"):
        out, lse = pagedvk.paged_attention_prefill(*case.args(), backend=backend)
        results[backend] = (out, lse) + pagedvk.paged_attention_backward(dout, *case.args(), out, lse, backend=backend)
    ops = ["paged_prefill", "paged_backward_dq", "paged_backward_dkdv"]
    assert used == [(op, "glsl") for op in ops] + [(op, "wgsl") for op in ops]
    # The same algorithm through two compilers: equal to float32 rounding.
    for a, b in zip(results["glsl"], results["wgsl"]):
        assert rel_error(b, a) <= 1e-6
