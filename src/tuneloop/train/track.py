"""Metrics: one JSON object per line in output_dir/metrics.jsonl, and a short line on stdout."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled  # only the main process writes

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            # NaN and inf are written as they are (json's NaN/Infinity): a bad loss must never vanish
            handle.write(json.dumps(record) + "\n")
            handle.flush()
        print(format_record(record), flush=True)


def format_record(record: dict) -> str:
    parts = []
    for key, value in record.items():
        if isinstance(value, float) and math.isfinite(value) and key not in ("epoch",):
            parts.append(f"{key} {value:.4g}")
        else:
            parts.append(f"{key} {value}")
    return " | ".join(parts)
