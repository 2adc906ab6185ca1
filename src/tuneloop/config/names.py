"""Parameter names as a config gives them (no torch: the schema's validator checks the patterns, adapters.py
matches them)."""

from __future__ import annotations

import re


def name_pattern(pattern: str) -> str:
    """axolotl's reading of an `unfrozen_parameters` pattern: a dot is a literal dot (parameter names are dotted
    paths), except in `.+`."""
    return re.sub(r"\.(?!\+)", r"\\.", pattern)
