"""Every ```python block of the docs runs on the CPU as written, so the examples cannot rot.

One test per page; a page's blocks run in order in one namespace (later blocks use earlier names). A block
right after a `<!-- no-run -->` line is skipped: those few need a GPU, several processes or a model that the
page only sketches. A block that is a source excerpt (a `--8<--` include of kernel code) is not an example
and is skipped too. docs/models.md and docs/programmable.md
are run by their own tests (tests/test_new_models_api.py, tests/test_flex_attention.py), so not here."""

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
RUN_ELSEWHERE = {"models.md", "programmable.md"}
BLOCK = re.compile(r"^(<!-- no-run -->\n)?```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The page's runnable python blocks, in order (blocks marked no-run left out)."""
    return [body for marker, body in BLOCK.findall(text) if not marker and not body.startswith("--8<--")]


PAGES = sorted(p for p in DOCS.rglob("*.md") if p.name not in RUN_ELSEWHERE and python_blocks(p.read_text()))


def test_collector_sees_the_pages():
    names = {p.relative_to(DOCS).as_posix() for p in PAGES}
    assert {"index.md", "algorithm/online-softmax.md", "theory/standard-attention.md"} <= names, names
    assert python_blocks("<!-- no-run -->\n```python\nx = 1\n```\n```python\ny = 2\n```\n") == ["y = 2\n"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_docs_page_examples_run(page, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    torch.manual_seed(0)
    namespace = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(page.read_text())):
        exec(compile(block, f"{page.relative_to(ROOT)} block {i}", "exec"), namespace)
