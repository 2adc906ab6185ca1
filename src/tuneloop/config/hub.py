"""What a config's Hub keys say, without the network or torch: `check`, the schema and the plan read it here, and
use/hub.py pushes by it (`hub_model_id`, `hub_strategy`, `hub_revision`)."""

from __future__ import annotations

# transformers' TrainingArguments default, which axolotl keeps when hub_strategy is unset
DEFAULT_STRATEGY = "every_save"
LAST_CHECKPOINT = "last-checkpoint"  # where hub_strategy: checkpoint keeps the newest checkpoint (the Trainer's name)


def strategy_of(cfg) -> str:
    return cfg.hub_strategy or DEFAULT_STRATEGY


def push_words(cfg, saves: int | None = None) -> str | None:
    """Where and what the run pushes, in one line (the plan's and `check`'s); None when it does not push."""
    if not cfg.hub_model_id:
        return None
    strategy = strategy_of(cfg)
    at_saves = {"end": "",
                "every_save": "the model at each save",
                "checkpoint": f"the model and the newest checkpoint (as {LAST_CHECKPOINT}/) at each save",
                "all_checkpoints": "the model and each checkpoint (as checkpoint-STEP/) at each save"}[strategy]
    if at_saves and saves is not None:
        at_saves += f" ({saves})" if saves else " (this run saves none)"
    what = f"{at_saves}, and the final model at the end" if at_saves else "the final model at the end"
    branch = f", branch {cfg.hub_revision}" if cfg.hub_revision else ""
    return f"to the Hugging Face Hub, {cfg.hub_model_id}{branch}: {what} (hub_strategy: {strategy})"


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is not a Hub repo id (huggingface_hub's own rule), or None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        return str(error).splitlines()[0]
    return None
