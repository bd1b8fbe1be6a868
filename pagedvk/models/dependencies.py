"""The `models` extra's packages (gguf, tokenizers), imported when first needed so that the base package runs
without them."""

from __future__ import annotations

import importlib

EXTRA = "pip install 'pagedvk[models]'"


def require(module: str):
    """Import one of the extra's packages, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"pagedvk.models needs the {module!r} package: {EXTRA}") from e
