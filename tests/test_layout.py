"""The README's layout map is written from the code: each module's (and package's) docstring, its first sentence.
A module added, moved or redescribed without the map following fails here; `TUNELOOP_WRITE_README=1 pytest
tests/test_layout.py` writes the map instead (as tests/test_axolotl_configs.py writes its block)."""

from __future__ import annotations

import ast
import os
import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "tuneloop"
README = REPO / "README.md"
README_BLOCK = ("<!-- layout: written by tests/test_layout.py from the modules' docstrings -->\n", "<!-- /layout -->\n")
NAME_WIDTH = 28  # the column the descriptions start at
WIDTH = 120
LONGEST_SUMMARY = 200  # characters: a first sentence is a summary, two lines of the map at most


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring, f"{path.relative_to(REPO)} has no docstring: say in one sentence what it holds"
    text = " ".join(docstring.split())
    return re.match(r"(.+?[.?!])(?=\s|$)", text).group(1) if re.search(r"[.?!](\s|$)", text) else text


def entry(indent: int, name: str, text: str) -> list[str]:
    """One module's lines: its name, then its summary wrapped at the descriptions' column."""
    first = f"{' ' * indent}{name}".ljust(NAME_WIDTH - 1) + " "
    return textwrap.wrap(text, width=WIDTH, initial_indent=first, subsequent_indent=" " * NAME_WIDTH,
                         break_long_words=False, break_on_hyphens=False)


def package_lines(folder: Path, indent: int) -> list[str]:
    """A package's modules (files first, then its packages, each by name) under it, each with its summary."""
    lines = []
    for path in sorted(folder.glob("*.py")):
        if path.name != "__init__.py":
            lines += entry(indent, path.name, summary(path))
    for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
        lines += entry(indent, f"{sub.name}/", summary(sub / "__init__.py"))
        lines += package_lines(sub, indent + 2)
    return lines


def layout_map() -> str:
    """The README's block: src/tuneloop/ as it stands, in a fenced block."""
    top = entry(0, "src/tuneloop/", summary(PACKAGE / "__init__.py"))
    return "\n".join(["```", *top, *package_lines(PACKAGE, 2), "```"]) + "\n"


def test_every_module_says_what_it_holds_in_a_short_first_sentence():
    long = {str(path.relative_to(PACKAGE)): len(summary(path)) for path in PACKAGE.rglob("*.py")
            if len(summary(path)) > LONGEST_SUMMARY}
    assert not long, f"first sentences longer than {LONGEST_SUMMARY} characters (the map's summary): {long}"


def test_the_readme_layout_map_is_the_code_s():
    """The README's map says what layout_map() writes; with TUNELOOP_WRITE_README=1 it is written there instead."""
    block = layout_map()
    text = README.read_text()
    start, end = text.index(README_BLOCK[0]) + len(README_BLOCK[0]), text.index(README_BLOCK[1])
    if os.environ.get("TUNELOOP_WRITE_README") == "1":
        README.write_text(text[:start] + block + text[end:])
        text = README.read_text()
    assert text[start:text.index(README_BLOCK[1])] == block, ("README.md's layout map has fallen behind the modules: "
                                                              "run `TUNELOOP_WRITE_README=1 pytest tests/test_layout.py`")
