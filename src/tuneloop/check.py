"""`tuneloop check CONFIG`: is this config one tuneloop runs, and what will it need? In well under a second.

It validates the config (every problem at once, one line each), and says what the run is and what it
needs of the machine, without reading data or the model and without importing torch.
"""

from __future__ import annotations

from tuneloop.config import TuneloopConfig
from tuneloop.config.hub import push_words
from tuneloop.host.hardware import hardware_needs
from tuneloop.resolved import Resolved, resolve_config
from tuneloop.online_rl.rewards import online_reward_names
from tuneloop.rl_methods import RL_METHODS, is_online, reference_source


def describe_config(cfg: TuneloopConfig, resolved: Resolved) -> list[str]:
    """What the run is, one line per part."""
    if cfg.adapter:
        targets = ("all linear layers" if cfg.lora_target_linear else
                   cfg.lora_target_modules if isinstance(cfg.lora_target_modules, str) else
                   ", ".join(cfg.lora_target_modules or cfg.lora_target_parameters or []))
        trained = f"{cfg.adapter} adapter, r={cfg.lora_r}, on {targets}"
    elif cfg.unfrozen_parameters:
        trained = f"full fine-tuning of the parameters matching {', '.join(cfg.unfrozen_parameters)}"
    elif cfg.from_scratch:
        spec = cfg.train_tokenizer
        trained = "trained from scratch (random weights)" + (
            f", with a {spec.type} tokenizer of {spec.vocab_size} tokens trained on the data" if spec else "")
    else:
        trained = "full fine-tuning"
    datasets = ", ".join(f"{_dataset_kind(entry, is_online(cfg))} ({entry.path})" for entry in cfg.train_entries)
    if resolved.streamed:
        datasets = f"streamed: {datasets}"
    batching = {"packed": "packed", "group_by_length": "grouped by length", "random": "padded",
                "token_budget": f"grouped by length, at most {cfg.max_tokens_per_micro_batch} tokens a micro-batch"
                }[resolved.batching]
    if is_online(cfg):
        batching = "padded"  # (each completion in its own row)
    length = f"max_steps {cfg.max_steps}" if cfg.max_steps else f"{cfg.num_epochs} epoch(s)"
    units = "rows"
    objective = []
    if is_online(cfg):
        settings = cfg.trl_settings
        units = "completions"
        objective = [f"  objective            rl: {cfg.rl}, {settings.num_generations} generations per prompt of "
                     f"at most {settings.max_completion_length} tokens, loss_type {settings.loss_type}; rewards "
                     f"{', '.join(online_reward_names(cfg))}"
                     + (f"; reference: {reference_source(cfg)}" if settings.beta else "")]
    elif cfg.reward_model:
        units = "pairs"
        coefficient = cfg.center_rewards_coefficient
        objective = ["  objective            reward model (Bradley-Terry: -log σ(r_chosen - r_rejected)), loss "
                     f"averaged over pairs" + (f", + {coefficient:g} × mean (r_chosen + r_rejected)²" if coefficient
                                               else "")]
    elif cfg.rl:
        method = RL_METHODS[cfg.rl]
        units = method.unit
        objective = [f"  objective            rl: {cfg.rl}, loss averaged over {units}"
                     + (f"; reference: {reference_source(cfg)}" if method.uses_reference else "")]
    return [
        f"  model                {cfg.base_model or cfg.base_model_config} ({cfg.model_type or 'its Auto class'}); "
        f"{trained}",
        f"  data                 {datasets}" + (f"; chat template {cfg.chat_template}" if cfg.chat_template else ""),
        f"  batch                {'at most ' if cfg.max_tokens_per_micro_batch else ''}{cfg.micro_batch_size} "
        f"{units}/micro-batch × {cfg.gradient_accumulation_steps} "
        f"accumulation, {batching}, sequence_len {cfg.sequence_len}, {length}",
        *objective,
        *([f"  engine               {resolved.engine.describe()}"] if resolved.engine.name != "ddp" else []),
        f"  optimizer            {cfg.optimizer}, learning rate {cfg.learning_rate:g}, {cfg.lr_scheduler} schedule",
        f"  precision            bf16: {cfg.bf16}{', fp16' if cfg.fp16 else ''}; attention "
        f"{resolved.attention.asked} (SDPA where the machine cannot run it)",
    ]


def _dataset_kind(entry, online: bool = False) -> str:
    if online:  # online RL reads prompts
        return f"prompts made by {entry.type}" if entry.type else "prompts"
    if entry.type is None:
        return "pre-tokenized"
    return entry.type if isinstance(entry.type, str) else "custom format"


def check_report(cfg: TuneloopConfig) -> list[str]:
    resolved = resolve_config(cfg)
    lines = ["tuneloop check: accepted", *describe_config(cfg, resolved)]
    push = push_words(cfg)
    if push:  # (the hub is not reached here: `train` checks the token and the repo when it starts)
        lines.append(f"  push                 {push}; the token and the hub are checked when `train` starts")
    needs = hardware_needs(cfg, resolved)
    lines += [f"  needs                {need}" for need in needs] or ["  needs                nothing special: "
                                                                     "runs on a CPU or a GPU"]
    lines.append("  not checked here     the data, the model and its tokenizer, this machine, trackers' credentials, "
                 "output_dir's disk (check reads the config and the small files it names: a DeepSpeed JSON, a local "
                 "base model's config.json or adapter_config.json, online RL's reward module; never data or weights, "
                 "and it imports no torch): `tuneloop plan CONFIG` checks them, as `train` does when it starts")
    return lines
