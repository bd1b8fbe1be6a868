"""Every ```python block in README.md and docs/*.md runs as written: each in a fresh namespace, so each is
self-contained. Blocks that must not run are written as ```text or ```sh."""
import re

import pytest

from support import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def examples() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(pytest.param(match.group(1), id=f"{page.relative_to(REPO)}:{line}"))
    return found


def test_pages_have_examples():
    assert examples()


@pytest.mark.parametrize("source", examples())
def test_example_runs(source, request):
    code = compile(source, request.node.callspec.id, "exec")
    exec(code, {"__name__": "__docs_example__"})
