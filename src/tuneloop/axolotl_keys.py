"""axolotl config keys that tuneloop does not implement (yet), sorted by what ignoring them would do.

An axolotl user's YAML must never be half-obeyed in silence. Each key below is accepted when it
is empty or false. When it is set:
- SPEED_OR_LOGGING_ONLY: ignoring it changes only speed, memory or what gets logged, so we warn;
- RESULT_CHANGING: ignoring it would train a different model, so it is an error.
Keys tuneloop implements live in the pydantic schema (config.py), not here.
"""

SPEED_OR_LOGGING_ONLY = {
    # kernels and fused ops: same maths, different speed
    "flash_attn_cross_entropy", "flash_attn_rms_norm", "flash_attn_fuse_qkv", "flash_attn_fuse_mlp",
    "xformers_attention", "s2_attention", "unsloth_cross_entropy_loss", "unsloth_lora_mlp",
    "unsloth_lora_qkv", "unsloth_lora_o", "unsloth_rms_norm", "unsloth_rope", "liger_rope",
    "liger_rms_norm", "liger_glu_activation", "liger_layer_norm", "liger_cross_entropy",
    "liger_fused_linear_cross_entropy", "cut_cross_entropy", "torch_compile", "torch_compile_backend",
    "torch_compile_mode", "sample_packing_eff_est", "total_num_tokens", "sample_packing_group_size",
    "sample_packing_bin_size", "pretrain_multipack_buffer_size",
    # data loading and process plumbing
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor",
    "dataloader_drop_last", "dataset_processes", "dataset_keep_in_memory", "ddp_timeout",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_find_unused_parameters", "device_map",
    "max_memory", "gpu_memory_limit", "lora_on_cpu", "low_cpu_mem_usage", "gc_steps",
    "include_tokens_per_second", "save_safetensors", "strict", "resize_token_embeddings_to_32x",
    "is_falcon_derived_model", "is_llama_derived_model", "is_qwen_derived_model",
    "is_mistral_derived_model", "tokenizer_use_fast", "tokenizer_legacy",
    # trackers and hubs: where metrics and models are sent, not what is trained
    "wandb_mode", "wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_run_id",
    "wandb_log_model", "mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name",
    "hf_mlflow_log_artifacts", "use_tensorboard", "use_wandb", "use_mlflow", "comet_api_key",
    "comet_workspace", "comet_project_name", "hub_model_id", "hub_strategy", "push_dataset_to_hub",
    "hf_use_auth_token", "eval_table_size", "eval_max_new_tokens", "eval_causal_lm_metrics",
    "do_causal_lm_eval", "debug", "profiler_steps", "log_level", "include_tkps",
}

RESULT_CHANGING = {
    "base_model_ignore_patterns", "base_model_config", "revision_of_model", "model_type",
    "tokenizer_type", "overrides_of_model_config", "model_config", "bnb_config_kwargs", "gptq",
    "load_in_8bit", "load_in_4bit", "bfloat16", "float16", "rl", "default_system_message",
    "pretraining_dataset", "lora_model_dir",
    "peft_layers_to_transform", "lora_fan_in_fan_out", "loraplus_lr_ratio", "loraplus_lr_embedding",
    "peft", "peft_use_dora", "peft_use_rslora", "relora_steps", "relora_warmup_steps",
    "relora_anneal_steps", "relora_prune_ratio", "relora_cpu_offload", "lr_quadratic_warmup",
    "lr_scheduler_kwargs", "cosine_constant_lr_ratio", "optim_args",
    "optim_target_modules", "neftune_noise_alpha", "noisy_embedding_alpha", "tokens",
    "added_tokens_overrides", "fsdp", "fsdp_config", "deepspeed", "unfrozen_parameters", "embeddings_skip_upcast",
    "chat_template_kwargs", "group_by_length_mega_batch", "curriculum_sampling", "multipack_real_batches",
    "bf16_full_eval", "fp8", "float32_matmul_precision",
}
