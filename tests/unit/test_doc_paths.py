"""Every repository path README.md and docs/ name exists (issue 25 item 5): a doc that cites a file that is not
in the repository (as ten comments cited a "DESIGN" document) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path under one of the repository's top-level folders (or a top-level file), as prose names it.
_PATH = re.compile(r"(?<![\w./-])((?:ddlfast|src|tests|bench|docs|scripts|examples)/[\w.-]+(?:/[\w.-]+)*/?"
                   r"|(?:CMakeLists\.txt|setup\.py|pyproject\.toml|requirements\.txt|MANIFEST\.in|LICENSE|CHANGELOG\.md))")
_LINK = re.compile(r"\]\(([^)#:]+)\)")  # markdown links to files: [text](path)


def named_paths(doc: Path) -> set[str]:
    text = doc.read_text()
    # a glob or a brace list (`ddlfast/_core*.so`, `exact_arithmetic.{h,cc}`) names several files: left out
    found = {m.group(1).rstrip(".") for m in _PATH.finditer(text) if text[m.end():m.end() + 1] not in ("*", "{")}
    found |= {str((doc.parent / m.group(1)).resolve().relative_to(ROOT)) for m in _LINK.finditer(text)}
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(doc: Path) -> None:
    missing = sorted(p for p in named_paths(doc) if not (ROOT / p).exists())
    assert missing == [], f"{doc.relative_to(ROOT)} names paths that are not in the repository: {missing}"


def test_no_comment_cites_the_design_document() -> None:
    citing = [str(p.relative_to(ROOT)) for p in [*ROOT.glob("ddlfast/**/*.py"), *ROOT.glob("tests/**/*.py"), *DOCS]
              if "DESIGN" in p.read_text() and p.name != "test_doc_paths.py"]
    assert citing == [], f"these cite a DESIGN document the repository does not have: {citing}"


def test_readme_layout_names_every_folder() -> None:
    """README's layout block names every folder of src/, tests/ and ddlfast/ (it described the tree before a
    refactor)."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("\n## ") if "\n## " in layout[3:] else len(layout)]
    folders = [f"src/{p.name}" for p in (ROOT / "src").iterdir() if p.is_dir()]
    folders += [f"tests/{p.name}" for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"]
    folders += [f"{p.name}/" for p in (ROOT / "ddlfast").iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert [f for f in folders if f not in layout] == []
