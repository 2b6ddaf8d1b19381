"""The README's usage example must run as written."""

import pathlib
import re


def test_readme_usage_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Usage\n```python\n(.*?)```", text, re.S)
    assert block, "README has no Usage python block"
    namespace = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    assert namespace["out"].shape == (1024, 16, 64)
