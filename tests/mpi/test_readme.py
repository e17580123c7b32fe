"""The docs' Python blocks (README.md, bench/README.md, docs/*.md) run, in order, as a reader would paste them
(issue 25 item 5): per file one program of every block under mpiexec on 4 ranks (README's blocks use a 2x2 torus
and 4-way counts). A block may be preceded by
`<!-- doc-test: setup: CODE -->` (the names a reader brings along, e.g. their gradients) or
`<!-- doc-test: skip: REASON -->` (it cannot run here, and says why and what runs it instead)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.mpi.launcher import run_mpi

ROOT = Path(__file__).resolve().parents[2]
READMES = ("README.md", "bench/README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))
                                             if "```python" in p.read_text()))
RANKS = 4
_BLOCK = re.compile(r"(?:<!-- doc-test: (setup|skip): (.*?) -->\n)?```python\n(.*?)```", re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str, str, str]]:
    """(line, marker kind or "", marker text, code) of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1) or "", m.group(2) or "", m.group(3))
            for m in _BLOCK.finditer(text)]


@pytest.mark.parametrize("readme", READMES)
def test_every_python_block_is_run_or_says_why_not(readme: str) -> None:
    text = (ROOT / readme).read_text()
    blocks = python_blocks(text)
    assert len(blocks) == text.count("```python"), "a doc-test marker that is not right above its block"
    for line, kind, note, _ in blocks:
        if kind == "skip":
            assert len(note.split()) >= 4, f"{readme}:{line}: a skipped block must say why (and what runs it)"
    assert any(kind != "skip" for _, kind, _, _ in blocks)


@pytest.mark.mpi
@pytest.mark.parametrize("readme", READMES)
def test_readme_blocks_run_in_order(readme: str, tmp_path: Path) -> None:
    # Nothing the blocks use is imported for them: a block that forgets an import fails here as it would for a reader.
    parts = ["import sys as _sys", "from mpi4py import MPI as _MPI", "_rank0 = _MPI.COMM_WORLD.Get_rank() == 0"]
    ran = []
    for line, kind, note, code in python_blocks((ROOT / readme).read_text()):
        if kind == "skip":
            continue
        if kind == "setup":
            parts.append(note)
        parts += [code, f"print('{readme}:{line} ok') if _rank0 else None", "_sys.stdout.flush()"]
        ran.append(line)
    program = tmp_path / "readme_blocks.py"
    program.write_text("\n".join(parts) + "\n")
    result = run_mpi(RANKS, str(program), timeout=300, env={"DDLFAST_TIMEOUT_S": "60"})
    for line in ran:
        assert f"{readme}:{line} ok" in result.stdout, result.stdout + result.stderr
