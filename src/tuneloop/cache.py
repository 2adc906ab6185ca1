"""Where tuneloop keeps what it builds once and reuses: the embedded model and data, measured machine figures."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TUNELOOP_CACHE``, else ``~/.cache/tuneloop``."""
    configured = os.environ.get("TUNELOOP_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "tuneloop"
