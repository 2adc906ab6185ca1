"""The run's config: axolotl-named YAML keys, validated, with errors a user can act on.

`load_config(path, overrides)` (or `config_from_dict`) is the only way in (load.py; `load_run_config` also resolves
the embedded demo aliases, as a run uses the config); the fields are
schema.py's and datasets.py's, the rules that tie keys together rules.py's, and axolotl's key table
axolotl.py's.
"""

from tuneloop.config.datasets import DatasetConfig
from tuneloop.config.load import config_from_dict, load_config, load_run_config
from tuneloop.config.schema import TuneloopConfig

__all__ = ["DatasetConfig", "TuneloopConfig", "config_from_dict", "load_config", "load_run_config"]
