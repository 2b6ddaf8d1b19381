"""The README and docs must agree with the code: the usage example runs as written, the settings table is
flashtile.config's list, and every file they link or cite exists."""

import pathlib
import re

from flashtile import config

ROOT = pathlib.Path(__file__).parents[1]
# run labels of a measurement diary; spelt in two pieces so that a grep of src/ and tests/ for the words (the rule
# this test enforces for the docs) does not find the rule itself
DIARY_WORDS = r"\b(" + "ses" + "sion|le" + "ase)s?\b"
README = (ROOT / "README.md").read_text()
DOCS = {p: p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}


def test_readme_usage_example_runs():
    block = re.search(r"## Usage\n```python\n(.*?)```", README, re.S)
    assert block, "README has no Usage python block"
    namespace = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    assert namespace["out"].shape == (1024, 16, 64)


def test_readme_settings_table_is_the_config_list():
    section = README.split("## Settings", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(FLASHTILE_\w+)` \|", section, re.M)
    assert listed == list(config.ENV_FIELDS), "README's settings table must list flashtile.config's variables, in order"
    for name, field in config.ENV_FIELDS.items():
        row = re.search(rf"^\| `{name}` \| (\w+) \|", section, re.M).group(1)
        default = field.default
        expected = "unset" if default is None else str(int(default))
        assert row == expected, (name, row, expected)


def test_readme_is_a_users_document():
    assert len(README.splitlines()) <= 200
    assert not re.search(DIARY_WORDS, README, re.I)


def test_cited_files_exist():
    """Links and `benchmarks/results/...` / `scripts/...` citations in README.md and docs/ name files that exist."""
    texts = {ROOT / "README.md": README, **DOCS}
    missing = []
    for path, text in texts.items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith("http") or target == "...":
                continue
            if not (path.parent / target).exists():
                missing.append(f"{path.name}: {target}")
        for cited in re.findall(r"((?:benchmarks/results|scripts|examples)/[\w.\-/]+\.(?:json|png|py|sh))", text):
            if not (ROOT / cited).exists():
                missing.append(f"{path.name}: {cited}")
        for name in re.findall(r"\b([a-z0-9\-]+_h[12]00_20\d\d-\d\d-\d\d\.(?:json|png))", text):
            if not (ROOT / "benchmarks" / "results" / name).exists():
                missing.append(f"{path.name}: {name}")
    assert not missing, missing


def test_every_result_file_is_cited():
    """benchmarks/results keeps only what the README and docs cite."""
    text = README + "".join(DOCS.values())
    results = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    uncited = [n for n in results if n not in text and n.rsplit(".", 1)[0] + ".json" not in text]
    assert not uncited, uncited
    assert len(results) <= 45


def test_docs_are_short_and_in_the_present_tense():
    for path, text in DOCS.items():
        assert len(text.splitlines()) <= 350, path.name
        assert not re.search(DIARY_WORDS, text, re.I), path.name


def test_code_speaks_in_the_present_tense():
    """No run labels or result-file names in src/ or tests/: a comment says why the code is as it is, and a
    measurement that is the reason is cited by its docs section."""
    result_file = re.compile(r"\w+_(h100|h200)_20\d\d-\d\d-\d\d\w*\.json")
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        text = path.read_text()
        assert not re.search(DIARY_WORDS, text, re.I), path
        assert not result_file.search(text), path


def test_docs_sections_cited_from_code_exist():
    """A comment citing `docs/page.md, "Section"` names a heading of that page (or a bold lead-in of a list item)."""
    cite = re.compile(r"(docs/[a-z_]+\.md), ['\"]([^'\"]+)['\"]")
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").glob("*")]):
        if path.is_dir() or path.name == "test_readme.py":
            continue
        for page, section in cite.findall(path.read_text()):
            text = (ROOT / page).read_text()
            heads = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
            leads = re.findall(r"\*\*([^*]+)\*\*", text)
            assert any(h.startswith(section) for h in heads) or any(b.startswith(section) for b in leads), \
                f"{path.name} cites {page}, {section!r}: no such section"
