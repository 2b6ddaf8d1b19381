"""The docs site builds with `mkdocs build --strict`: a broken link, a missing snippet file or section marker,
or a docstring mkdocstrings cannot render fails the suite. make test installs docs/requirements.txt, so CI
runs this; elsewhere it is skipped when mkdocs is not installed."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tools are not installed (pip install -r docs/requirements.txt)")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -r docs/requirements.txt)")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -r docs/requirements.txt)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # snippets resolve --8<-- paths from the working directory: the repository root
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Reading paths" in home
    walk = (tmp_path / "site" / "kernels" / "attn-fwd-walk" / "index.html").read_text()
    assert "_softmax_update" in walk and "--8&lt;--" not in walk, "snippets were not included"
    api = (tmp_path / "site" / "api" / "reference" / "index.html").read_text()
    assert "cu_seqlens_q" in api, "the API reference has no docstrings"
