"""Vision-language families: one file each, declaring its records, and the tables everything else reads from them.

A family file (every module here whose name does not start with "_") holds `FAMILIES`, a tuple of records: a
`VisionFamily` per model type tuneloop trains, an `UntrainedFamily` per model type it knows by name and refuses.
A record says, for its model type: the hub ids that name it, its words, how its chat text writes an image and how
the processor expands it (data/images.py), its vision modules (`freeze_mm_modules`, plan/flops.py), the processor
setting that makes an image fewer tokens, and the positions its vision tower runs (plan/flops.py). The records of
one file are one family in the lists of families (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5).

No torch here, nor in the family files: `check` (config/vision_names.py, config/axolotl.py) reads these tables.
Collected by listing this package, so a new family is its file alone (and a tiny twin and a test: see
tests/test_vision_family_records.py).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections import Counter

from tuneloop.vision_families._record import KnownVisionFamily, UntrainedFamily, VisionFamily

def _family_files() -> dict[str, tuple[KnownVisionFamily, ...]]:
    """Every family file's records, by file name (sorted: the order of the lists of families)."""
    files = {}
    for found in sorted(pkgutil.iter_modules(__path__), key=lambda found: found.name):
        if found.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{found.name}")
        records = getattr(module, "FAMILIES", None)
        if not isinstance(records, tuple) or not all(isinstance(record, KnownVisionFamily) for record in records):
            raise TypeError(f"{module.__name__} must declare FAMILIES, a tuple of VisionFamily or UntrainedFamily "
                            "records (a module of this package that is not a family starts with _)")
        files[found.name] = records
    return files


FAMILY_FILES = _family_files()
_RECORDS = [record for records in FAMILY_FILES.values() for record in records]
_TWICE = [name for name, count in Counter(record.name for record in _RECORDS).items() if count > 1]
if _TWICE:  # (one model type, one record: the tables below would keep only one of them)
    raise ValueError(f"vision families declared twice: {', '.join(_TWICE)}")

# model type -> record (and the tables derived from them: nothing below is kept by hand)
VISION_FAMILIES = {record.name: record for record in _RECORDS if isinstance(record, VisionFamily)}
UNTRAINED_FAMILIES = {record.name: record for record in _RECORDS if isinstance(record, UntrainedFamily)}
TRAINED_VISION_TYPES = tuple(VISION_FAMILIES)
VISION_FAMILY_WHY_NOT = {name: record.why_not for name, record in UNTRAINED_FAMILIES.items() if record.why_not}


def in_words(items) -> str:
    """"A, B and C"."""
    items = list(items)
    return " and ".join(filter(None, (", ".join(items[:-1]), *items[-1:])))


def _file_words(records) -> str:
    """A family file's records in words, each family's words once: "Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5"."""
    return " / ".join(dict.fromkeys(record.words for record in records))


def _trained_words(wanted=lambda family: True) -> str:
    return in_words(_file_words(chosen) for records in FAMILY_FILES.values()
                    if (chosen := [r for r in records if isinstance(r, VisionFamily) and wanted(r)]))


TRAINED_VISION_WORDS = _trained_words()
UNPACKED_VISION_WORDS = _trained_words(lambda family: not family.packs)  # (families whose rows do not pack)


def packing_families() -> str:
    return ", ".join(name for name, family in VISION_FAMILIES.items() if family.packs)


def family_named_by(hub_id: str) -> KnownVisionFamily | None:
    """The family whose hub-id pattern a hub id contains. Where several do, the longest match wins, the more
    specific name ("gemma-3n" over "gemma-3", "Idefics3" over "Idefics", "Qwen3-VL-30B-A3B" over "Qwen3-VL"),
    so no file's patterns depend on another's order (a tie goes to the record listed first)."""
    best, best_length = None, 0
    for record in _RECORDS:
        for pattern in record.hub_ids:
            match = re.search(pattern, hub_id, flags=re.IGNORECASE)
            if match and len(match.group()) > best_length:
                best, best_length = record, len(match.group())
    return best
