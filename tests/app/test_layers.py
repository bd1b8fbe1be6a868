"""The package's layers: every module imports only from its own layer or the layers below, with no cycles, and
what build_shaders.py loads without the package stays stdlib-only.

Read from the sources with `ast` (no module is imported), function-level imports included: a lazy import that
runs up a layer or closes a cycle is still a dependency, only a later one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from support import REPO

PACKAGE = REPO / "pagedvk"

# Bottom to top. A module's layer is its top-level name under pagedvk (pagedvk.ops.decode: "ops"); the package's own
# __init__ ("pagedvk") and the command line sit on top.
LAYERS = (
    ("errors", "config", "dtypes"),
    ("runtime",),
    ("kernels",),
    ("ops",),
    ("engine",),
    ("testing",),
    ("models",),
    ("demo",),
    ("serve",),
    ("cli", ""),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}

# What build_shaders.py loads by path (load_module) where the run-time dependencies may be absent, and the package
# __init__ files that loading runs.
BUILD_MODULES = ("pagedvk.kernels.abi", "pagedvk.kernels.catalogue", "pagedvk.kernels.spirv",
                 "pagedvk.kernels.spirv_passes")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports(name: str) -> dict:
    """{imported module: line} of a package module: its own modules (each package on the way to one included, as
    importing runs their __init__), and the top-level names of everything else."""
    found = {}
    base = name.split(".") if is_package(name) else name.split(".")[:-1]
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            # `from pkg import name`: the module pkg.name where there is one
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in MODULES]
        else:
            continue
        for target in targets:
            if target == "pagedvk" or target.startswith("pagedvk."):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):   # pagedvk.ops.decode runs pagedvk/__init__ and ops/__init__ too
                    prefix = ".".join(parts[:i])
                    if prefix in MODULES and prefix != name and (i > 1 or name == "pagedvk"):
                        found.setdefault(prefix, node.lineno)
            else:
                found.setdefault(target.split(".")[0], node.lineno)
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYER[parts[1] if len(parts) > 1 else ""]


def test_every_module_has_a_layer():
    assert [name for name in MODULES if (name.split(".") + [""])[1] not in LAYER] == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{name} (layer {LAYERS[layer(name)]}) imports {target} (layer {LAYERS[layer(target)]}) at line {line}"
              for name in MODULES for target, line in imports(name).items()
              if target in MODULES and layer(target) > layer(name)]
    assert upward == []


def test_no_import_cycles():
    graph = {name: [t for t in imports(name) if t in MODULES] for name in MODULES}
    cycles, state = [], {}

    def visit(name, path):
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", BUILD_MODULES)
def test_what_the_build_loads_is_stdlib_only(name):
    # build_shaders.py runs before the run-time dependencies (vulkan, numpy) are installed: the modules it loads,
    # the package __init__ files on their way (but pagedvk's own, which the build skips) and what they import
    # must need the standard library only.
    seen, todo, outside = set(), [name], []
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for target in imports(current):
            if target in MODULES:
                if target != "pagedvk":
                    todo.append(target)
            elif target not in sys.stdlib_module_names and target != "__future__":
                outside.append(f"{current} imports {target}")
    assert outside == []


def test_every_sub_package_says_what_it_holds_and_its_layer():
    packages = [name for name in MODULES if is_package(name) and name != "pagedvk"]
    assert packages
    for name in packages:
        doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
        assert doc and doc.startswith(f"Layer {layer(name)},"), name
