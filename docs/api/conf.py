"""Sphinx configuration of the API reference (docs/api/): generated from the docstrings by autodoc.

    .venv/bin/python -m sphinx -W -b html docs/api out/api     # tests/unit/test_api_reference.py runs it

The docstrings are written as plain text (indented examples, aligned lists), not reStructuredText, so each is
shown as it is written, in a literal block: the reference then reads like the source and builds without warnings.
"""

from __future__ import annotations

import ddlfast

project = "ddlfast"
release = version = ddlfast.__version__
extensions = ["sphinx.ext.autodoc"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
html_theme = "alabaster"
exclude_patterns = ["_build"]


def _as_written(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    if any(line.strip() for line in lines):
        lines[:] = ["::", "", *("    " + line for line in lines), ""]


def setup(app: object) -> None:
    app.connect("autodoc-process-docstring", _as_written)  # type: ignore[attr-defined]
