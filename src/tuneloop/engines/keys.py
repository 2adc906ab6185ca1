"""Which engine a config asks for, from axolotl's keys as users write them (no torch here: `check` reads it).

- no `fsdp`/`deepspeed` key: DDP (ddp.py), every rank a whole copy; one process is this engine too;
- `fsdp` / `fsdp_version` / `fsdp_config`: FSDP2 (fsdp2.py reads its keys);
- `deepspeed: path/to.json`: DeepSpeed ZeRO, stage 1/2/3 from that file (deepspeed.py reads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneloop.engines.base import EngineSpec
from tuneloop.engines.ddp import DDPSpec
from tuneloop.engines.deepspeed import DeepSpeedSpec, read_deepspeed_keys
from tuneloop.engines.fsdp2 import FSDP2Spec, read_fsdp_keys
from tuneloop.registry import Registry

ENGINES: Registry[type[EngineSpec]] = Registry("engine", "fsdp/deepspeed")
ENGINES.add("ddp", DDPSpec)
ENGINES.add("fsdp2", FSDP2Spec)
ENGINES.add("deepspeed", DeepSpeedSpec)


def read_engine(fsdp: Any, fsdp_version: Any, fsdp_config: dict | None, deepspeed: Any,
                config_dir: Path | None = None) -> EngineSpec:
    """The engine the keys ask for. A ValueError names the key and the fix (config/rules.py reports it)."""
    if deepspeed and (fsdp or fsdp_config):
        raise ValueError("`deepspeed` and `fsdp`/`fsdp_config` ask for two engines at once; keep one of them")
    if deepspeed:
        return read_deepspeed_keys(deepspeed, config_dir)
    if fsdp or fsdp_config or fsdp_version:
        return read_fsdp_keys(fsdp, fsdp_version, fsdp_config or {})
    return DDPSpec()
