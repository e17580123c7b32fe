"""The API reference (docs/api/) builds from the docstrings without a warning (issue 25 item 5), and documents
the public names users call."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddlfast

ROOT = Path(__file__).resolve().parents[2]


def test_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("sphinx")
    built = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(ROOT / "docs" / "api"),
                            str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    text = html.unescape(re.sub(r"<[^>]+>", "", (tmp_path / "index.html").read_text()))
    forms = ("ddlfast.{}(", "class ddlfast.{}", "exception ddlfast.{}")  # a function, a class, an exception
    missing = [name for name in ddlfast.__all__ if not any(form.format(name) in text for form in forms)]
    assert missing == [], f"the reference lacks {missing}"
    for name in ("ddlfast.integrations.torch.distribute(", "ddlfast.compression.TopKCodec"):
        assert name in text
