"""Finds the SPIR-V module of an op for a backend and storage variant, and its pipeline on a device.

Modules are built ahead of time (build_shaders.py, run by `pip install`); nothing compiles at run time.
In a source checkout the module's recorded source digest is compared with the shaders on disk (its source and
the includes the build recorded it using), so a module built from older sources is refused instead of silently
running stale code. The manifest also records which backends were built: an install made without naga has
GLSL modules only, and asking it for WGSL says how to get them.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from .. import config
from ..errors import ShaderModuleError, UnsupportedFeatureError
from ..runtime.pipeline import Pipeline
from . import abi as abi_mod

PACKAGE_DIR = Path(__file__).resolve().parent.parent   # pagedvk/
SPV_DIR = config.spv_dir(PACKAGE_DIR / "spv")
SOURCE_SHADER_DIR = PACKAGE_DIR.parent / "shaders"  # present in a source checkout only
REBUILD_HINT = "rebuild with `python build_shaders.py` (or reinstall with `pip install .`)"
# What to do when the install has no modules of a backend (the build skips WGSL where it finds no naga).
MISSING_BACKEND_HINT = {
    "wgsl": "run `npm ci` in the source tree and reinstall (`pip install .`), or put a naga CLI on PATH and reinstall",
}

_manifest = None
_lock = threading.Lock()


def manifest() -> dict:
    global _manifest
    if _manifest is None:
        path = SPV_DIR / "manifest.json"
        if not path.is_file():
            raise ShaderModuleError(f"no SPIR-V modules in {SPV_DIR} (manifest.json missing): {REBUILD_HINT}")
        _manifest = json.loads(path.read_text())
    return _manifest


def forget_manifest() -> None:
    """Drop the manifest manifest() read, so that the next call reads SPV_DIR's again (after SPV_DIR changes:
    tests point it at a folder of their own)."""
    global _manifest
    _manifest = None


def module_path(name: str) -> Path:
    return SPV_DIR / f"{name}.spv"


def require_backend(backend: str) -> None:
    """Raise ShaderModuleError, saying how to get them, if this install was built without `backend`'s modules
    (manifests that predate the record of built backends pass)."""
    built = manifest().get("backends")
    if built is not None and backend not in built:
        raise ShaderModuleError(f"this install has no {backend.upper()} modules (built: {', '.join(built) or 'none'}): "
                                f"{MISSING_BACKEND_HINT.get(backend, REBUILD_HINT)}")


def is_current(entry: dict, key: abi_mod.VariantKey) -> bool:
    """Whether a module's manifest entry matches the shaders in SOURCE_SHADER_DIR: its source and the includes
    it was built with (entry["includes"]; every include file for entries without that list)."""
    try:
        return entry["digest"] == abi_mod.source_digest(SOURCE_SHADER_DIR, key, entry.get("includes"))
    except OSError:   # a file it was built from is gone
        return False


def load_spirv(kernel: abi_mod.KernelABI, key: abi_mod.VariantKey) -> bytes:
    if key not in set(kernel.keys()):
        raise ShaderModuleError(f"{kernel.op} has no module {key.name}")
    require_backend(key.backend)
    path = module_path(key.name)
    entry = manifest().get(key.name)
    if entry is None or not path.is_file():
        raise ShaderModuleError(f"SPIR-V module {key.name} is missing ({path}): {REBUILD_HINT}")
    source = SOURCE_SHADER_DIR / entry["source"]
    if source.is_file() and not is_current(entry, key):
        raise ShaderModuleError(f"SPIR-V module {key.name} is stale: {source} (or a file it includes) changed "
                                f"after it was built; {REBUILD_HINT}")
    return path.read_bytes()


def specialized(kernel: abi_mod.KernelABI, key: abi_mod.VariantKey, variants: bool = True,
                constants: dict | None = None) -> tuple:
    """(the device's pipeline cache key, {constant_id: value}) of the pipeline `pipeline` makes for these
    arguments; benchmarks that swap a pipeline for an experiment's use it too."""
    plain = not variants and kernel.specializes_variants(key)
    declared = kernel.specialization_constants(key)
    own = {i: v for i, v in (constants or {}).items() if i in declared}
    specialization = {**({kernel.spec_id("VARIANTS"): False} if plain else {}), **own}
    return (key, "plain" if plain else "", tuple(sorted(own.items()))), specialization


def pipeline(device, kernel: abi_mod.KernelABI, key: abi_mod.VariantKey, variants: bool = True,
             constants: dict | None = None) -> Pipeline:
    """The device's pipeline for this module, created on first use and kept until the device closes.

    variants=False: the pipeline for launches without attention variants (no VARIANT_* flag, softcap or
    window), with the variants' code specialized away where the module allows it (its spec_ids.VARIANTS).
    constants: {constant_id: value} of the op's own specialization constants (KernelABI.spec_constants), set
    where the module declares them (GLSL) and ignored where it does not (WGSL).
    """
    missing = [f for f in key.requires() if f not in device.features]
    if missing:
        raise UnsupportedFeatureError(f"{key.name} needs the Vulkan feature(s) {', '.join(missing)}, which "
                                      f"{device.info.name} does not have (or pagedvk did not enable)")
    cache_key, specialization = specialized(kernel, key, variants, constants)
    plain = cache_key[1] == "plain"
    with _lock:
        cached = device.pipelines.get(cache_key)
        if cached is None or cached.closed:
            cached = device.pipelines[cache_key] = Pipeline(
                device, kernel, load_spirv(kernel, key), key.name + (" (no variants)" if plain else ""),
                kernel.bindings_for(key), specialization or None)
        return cached
