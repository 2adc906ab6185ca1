"""Names a config gives that other code reads the same way: parameter-name patterns and Hub repo ids (no torch:
the schema's validators check them, and adapters.py and use/hub.py use them)."""

from __future__ import annotations

import re


def name_pattern(pattern: str) -> str:
    """axolotl's reading of an `unfrozen_parameters` pattern: a dot is a literal dot (parameter names are dotted
    paths), except in `.+`."""
    return re.sub(r"\.(?!\+)", r"\\.", pattern)


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is not a Hub repo id (huggingface_hub's own rule), or None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        return str(error).splitlines()[0]
    return None
