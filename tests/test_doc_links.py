"""Every link between the project's Markdown files names a file and a heading that exist,
so a renamed results entry or doc section does not leave dead links behind."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = {".venv", ".git", "node_modules", ".pytest_cache"}
LINK = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")


def markdown_files() -> list[Path]:
    """The project's Markdown files: those git does not ignore (not the copies of older
    code a benchmark carries in `.old`), or, outside a checkout, all but SKIP's."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:  # no git installed
        listed = None
    if listed is not None and listed.returncode == 0:
        return sorted(ROOT / line for line in listed.stdout.splitlines() if (ROOT / line).exists())
    return sorted(p for p in ROOT.rglob("*.md") if not SKIP & set(p.relative_to(ROOT).parts[:-1]))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def test_slug_follows_github():
    assert slug("Formulas and mixed loads at `9457763` (2026-12-05)") == (
        "formulas-and-mixed-loads-at-9457763-2026-12-05"
    )


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_name_existing_headings(path: Path):
    dead = []
    for target, anchor in LINK.findall(path.read_text()):
        file = (path.parent / target).resolve() if target else path
        if not file.is_file():
            dead.append(f"{target}#{anchor}: no such file")
        elif anchor not in anchors(file):
            dead.append(f"{target}#{anchor}: no such heading")
    assert not dead, dead
