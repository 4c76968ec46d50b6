"""The documentation: README.md's figures are the ones bench/RESULTS.md records, its links
lead to files that exist, and the site builds with no warning (mkdocs build --strict).

    python3 -m pytest tests/python/test_docs.py
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "bench" / "RESULTS.md").read_text()
#: A figure: thousands with commas (9,458), or a decimal (1.73, 13.3).
FIGURE = re.compile(r"\b\d{1,3}(?:,\d{3})+\b|\b\d+\.\d+\b")


def figures_section() -> str:
    """README.md's "Figures" section, from its heading to the next one."""
    start = README.index("\n## Figures\n")
    return README[start:README.index("\n## ", start + 1)]


def test_every_figure_the_readme_quotes_is_recorded_in_the_results():
    quoted = FIGURE.findall(figures_section())
    assert len(quoted) >= 10, quoted  # the table is there and holds figures
    missing = [figure for figure in quoted if figure not in RESULTS]
    assert not missing, f"README.md quotes figures bench/RESULTS.md does not hold: {missing}"


def test_every_figure_of_the_results_page_is_recorded_in_the_results():
    """docs/results.md, today's figures: each one is in bench/RESULTS.md."""
    page = (ROOT / "docs" / "results.md").read_text()
    quoted = FIGURE.findall(page)
    assert len(quoted) >= 20, quoted
    missing = [figure for figure in quoted if figure not in RESULTS]
    assert not missing, f"docs/results.md quotes figures bench/RESULTS.md does not hold: {missing}"


def test_every_throughput_any_page_quotes_is_recorded_in_the_results():
    """Figures in thousands (tokens/s, parameters, 8,439) on every page of the site and in
    the READMEs are measured ones: each is in bench/RESULTS.md. Sizes of the page itself (a
    1,280 px screen) and of the report's format (4,096 samples) are not figures."""
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "lib" / "README.md"]
    missing = {}
    for page in pages:
        for match in re.finditer(r"\b\d{1,3}(?:,\d{3})+\b(?! px| samples| records)", page.read_text()):
            if match.group(0) not in RESULTS:
                missing.setdefault(page.name, []).append(match.group(0))
    assert not missing, f"pages quote figures bench/RESULTS.md does not hold: {missing}"


def test_the_readmes_links_lead_to_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_the_site_builds_with_no_warning(tmp_path):
    pytest.importorskip("mkdocs", reason="skipped: MkDocs is not installed (scripts/test.sh "
                                         "installs mkdocs-material)")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                            env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "settings" / "index.html").exists()
