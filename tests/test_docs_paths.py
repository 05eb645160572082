"""Every path the documentation cites exists, and every cited results row is in docs/results.md.

Checked: Markdown links and image links in README.md and docs/*.md (relative to the page),
and the repository paths (`docs/`, `scripts/`, `pdserve/`, `tests/`) named anywhere in those
pages and in the sources of pdserve, the scripts and the tests (relative to the repository
root). A path
under `shared/` is outside the repository, so no page may cite one. A citation of a
docs/results.md row by name (`docs/results.md, "name"`) must name a row that is there.
Output paths in example commands (`results/...`, `OUT`) are not citations and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_CHECKED = frozenset(
    {
        # The vLLM P/D driver is being replaced by a new one (issue 29); it still cites the
        # work log that left docs/. Drop this entry when the new driver lands.
        ROOT / "scripts/bench/perf/vllm_pd_ab.py",
        Path(__file__).resolve(),  # its own examples name files that do not exist
    }
)
SOURCES = [
    *sorted((ROOT / "pdserve").rglob("*.py")),
    *sorted((ROOT / "pdserve").rglob("*.json")),
    *sorted((ROOT / "scripts").rglob("*.py")),
    *sorted((ROOT / "scripts").rglob("*.sh")),
    *sorted((ROOT / "tests").glob("*.py")),
]
SOURCES = [s for s in SOURCES if s not in NOT_CHECKED]

MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# Not after `[`: a link's text may name a file of another repository; its target is checked.
REPO_PATH = re.compile(r"(?<![\w./<\[-])((?:docs|scripts|pdserve|tests)/[\w./<>*-]*[\w>*])")
PLACEHOLDER = re.compile(r"[*<]|/[A-Z][A-Z_]*(?=[./]|$)")  # a glob, <x> or NAME
SHARED_PATH = re.compile(r"(?<![\w.-])(?:\.\./)?shared/[\w./-]+")
RESULTS_ROW = re.compile(r"docs/results\.md,\s*[\"']([^\"']+)[\"']")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _link_targets(text: str) -> list[str]:
    targets = []
    for target in MD_LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


def _repo_paths(text: str) -> list[str]:
    # A glob or a placeholder (`pdserve/sim/profiles/**/*.json`, `tests/test_<x>.py`,
    # `.../NAME.json`) names
    # no single file: only the folder it lies in must exist.
    found = []
    for path in REPO_PATH.findall(text):
        m = PLACEHOLDER.search(path)
        if m is None:
            found.append(path.rstrip("."))
        else:
            head = path[: m.start()]
            found.append(head if path[m.start()] == "/" else head.rsplit("/", 1)[0])
    return found


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_page_links_resolve(page: Path) -> None:
    text = page.read_text()
    missing = [t for t in _link_targets(text) if t and not (page.parent / t).exists()]
    assert missing == [], f"{_rel(page)} links to missing files: {missing}"


@pytest.mark.parametrize("source", PAGES + SOURCES, ids=_rel)
def test_cited_repo_paths_exist(source: Path) -> None:
    text = source.read_text()
    missing = sorted({p for p in _repo_paths(text) if not (ROOT / p).exists()})
    assert missing == [], f"{_rel(source)} cites paths not in the repository: {missing}"
    shared = SHARED_PATH.findall(text)
    assert shared == [], f"{_rel(source)} cites paths outside the repository: {shared}"


def test_cited_results_rows_exist() -> None:
    results = _flat((ROOT / "docs" / "results.md").read_text()).lower()
    missing = []
    for source in PAGES + SOURCES:
        for name in RESULTS_ROW.findall(source.read_text()):
            if _flat(name).lower() not in results:
                missing.append(f"{_rel(source)}: {name!r}")
    assert missing == [], f"rows cited but not in docs/results.md: {missing}"


def test_the_checks_see_citations() -> None:
    """The patterns find what they are meant to: a check that matches nothing passes always."""
    sample = (
        "see [x](docs/a.md#s), ![i](img/b.png), `scripts/bench/c.py --help`,"
        " tests/test_<x>.py, pdserve/a/NAME.json"
    )
    assert _link_targets(sample) == ["docs/a.md", "img/b.png"]
    assert _repo_paths(sample) == ["docs/a.md", "scripts/bench/c.py", "tests", "pdserve/a"]
    assert RESULTS_ROW.findall('(docs/results.md, "dtype on CPU")') == ["dtype on CPU"]
    assert SHARED_PATH.findall("from ../shared/design/x.md") == ["../shared/design/x.md"]
