"""Every axolotl config key, classified once: what tuneloop does with it.

axolotl's schema (commit 067b021, `src/axolotl/utils/schemas` and its plugins' args) knows 528
keys. A key that tuneloop implements is a field of its own schema (config/schema.py). Every other axolotl key
is in exactly one of the tables below, so an axolotl user's YAML is never half-obeyed in silence:

- SPEED_OR_LOGGING: ignoring it changes only speed, memory or what is logged: a warning when set;
- LAUNCHER: filled in by launchers and axolotl itself (`local_rank`, ...): accepted and ignored;
- REFUSED: ignoring it would train something else: refused when set, naming the feature (FEATURES: the
  README's list of what tuneloop does not do yet);
- REMOVED: keys axolotl itself has since removed or deprecated away: refused when set.

Every key is accepted when blank (YAML `key:` with no value), as in axolotl. A key in none of the
tables and not in the schema is unknown: the error names the nearest key of all of them (config/load.py).
"""

from __future__ import annotations

from tuneloop import vision_families


def _multimodal_not_yet() -> str:
    """FEATURES["multimodal"]'s text, its families from their records (tuneloop/vision_families/)."""
    wanting = [family for family in vision_families.UNTRAINED_FAMILIES.values() if family.needs]
    libraries = " or ".join(dict.fromkeys(family.needs for family in wanting))
    return (f"multimodal models beyond {vision_families.TRAINED_VISION_WORDS} "
            f"({vision_families.in_words(family.words for family in wanting)} need {libraries}), audio and video "
            f"parts, packing of the rows of {vision_families.UNPACKED_VISION_WORDS}, and streaming or preference "
            "training of vision-language models")


# feature -> (a short name for messages, what it covers for the README's list of what tuneloop does not do yet)
FEATURES = {
    "preference": ("this preference/RL training", "preference and RL training beyond DPO, IPO, ORPO, KTO, SimPO, "
                   "GRPO, GDPO, structured EBFT, Bradley-Terry reward models and process reward models (EBFT's "
                   "strided and multi-turn modes; options such as rpo_alpha)"),
    "fsdp_deepspeed": ("DeepSpeed's deepcompile", "DeepSpeed's deepcompile"),
    "fsdp2_8bit": ("8-bit weights under FSDP2", "8-bit weights (`load_in_8bit`) sharded by FSDP2 (bitsandbytes keeps "
                   "an 8-bit weight's scales on the parameter FSDP2 replaces; QLoRA under FSDP2 or ZeRO-3, and 8-bit "
                   "under DeepSpeed or DDP, work)"),
    "fsdp2_bnb_optimizer": ("a bitsandbytes optimizer under FSDP2", "bitsandbytes' optimizers (`adamw_bnb_8bit`, "
                            "`paged_adamw_8bit`, `paged_adamw_32bit`) under FSDP2 (their kernels step plain tensors, and "
                            "FSDP2 hands the optimizer DTensor shards; torch's AdamW under FSDP2, and bitsandbytes' "
                            "optimizers on DDP ranks or DeepSpeed, work)"),
    "parallelism": ("expert parallelism", "expert parallelism, tensor parallel of adapters, 4/8-bit weights or "
                    "streams, context parallel of preference or reward losses (axolotl's device mesh otherwise "
                    "works: `dp_shard_size`, `dp_replicate_size` (HSDP), `tensor_parallel_size` of a whole model "
                    "under FSDP2 and `context_parallel_size` (Ulysses) on DDP or FSDP2; sizes of 1 are accepted)"),
    "ray": ("launching on a Ray cluster", "launching on a Ray cluster (`use_ray`, `ray_num_workers`, "
            "`resources_per_worker`): tuneloop is launched with torchrun on each node (examples/slurm/ on Slurm)"),
    "multimodal": ("multimodal models", _multimodal_not_yet()),
    "quantization": ("quantization beyond bitsandbytes", "quantization other than bitsandbytes 4/8-bit loading, "
                     "MXFP4 dequantized at load and int4/int8 QAT (GPTQ, torchao loading, fp8, NVFP4/MXFP4 QAT, QAT "
                     "under FSDP2 or DeepSpeed, 1-bit models)"),
    "moe": ("MoE-specific options", "MoE options that change the result (8-bit experts, linearized experts, "
            "DenseMixer, expert kernels)"),
    "peft_variants": ("a LoRA variant", "LoRA variants and PEFT options (PiSSA, OLoRA, CorDA, LoftQ and EVA starts, "
                      "rank/alpha patterns, layer selection and replication, MoRA, trainable token indices)"),
    "training_methods": ("another training method", "other training methods (ReLoRA, LISA, jagged restarts, NEFTune, "
                         "PoSE, distillation, diffusion LMs, EAFT, Spectrum, automatic batch size)"),
    "pretraining": ("a pretraining stream option", "pretraining stream options (attention across packed documents, "
                    "sample concatenation)"),
    "data_options": ("a dataset option", "dataset options tuneloop does not have yet (custom transforms, "
                     "per-message training flags, sharded hub datasets, length strategies, a default system "
                     "message)"),
    "model_options": ("a model option", "model options tuneloop does not have yet (model kwargs, custom model or "
                      "trainer classes, half-precision weights, embedding resizing, attention scaling)"),
    "optimizer_options": ("an optimizer option", "optimizer options tuneloop does not have yet (optim_args, scheduler "
                          "kwargs, per-group or embedding learning rates, Dion, Q-GaLore, Grokfast)"),
    "plugins": ("an axolotl plugin", "axolotl plugins other than Liger, CutCrossEntropy, kernels and SwanLab"),
    "chat_templates": ("a chat template tuneloop does not have", "chat template names beyond axolotl's list (tuneloop "
                       "has every name axolotl's schema knows): `chat_template: jinja` with the template's text, or "
                       "`tokenizer_default`, work for any template"),
    "dataset_types": ("a dataset type tuneloop does not have", "dataset types other than alpaca, alpaca:chat, "
                      "completion, seq2seq, chat_template (chat_template.default), sharegpt and the custom format "
                      "mapping"),
}

# `optimizer:` values axolotl (or the Trainer under it) takes that tuneloop does not: each named in its refusal
OPTIMIZERS_ELSEWHERE = {
    "dion": "Dion",
    "optimi_adamw": "optimi's AdamW", "ao_adamw_4bit": "torchao's 4-bit AdamW (tuneloop: adamw_torch_4bit)",
    "ao_adamw_8bit": "torchao's 8-bit AdamW (tuneloop: adamw_torch_8bit)", "ao_adamw_fp8": "torchao's fp8 AdamW",
    "adopt_adamw": "ADOPT", "came_pytorch": "CAME", "sinkgd": "SinkGD", "flash_adamw": "FlashOptim's AdamW",
    "flash_adam": "FlashOptim's Adam", "flash_sgd": "FlashOptim's SGD", "flash_sgdw": "FlashOptim's SGDW",
    "flash_lion": "FlashOptim's Lion", "q_galore_adamw8bit": "Q-GaLore", "adamw_hf": "transformers' own AdamW",
    "adamw_apex_fused": "apex's fused AdamW", "adamw_anyprecision": "AnyPrecision AdamW", "adagrad": "Adagrad",
    "rmsprop": "RMSprop", "lion_32bit": "Lion", "lion_8bit": "8-bit Lion", "paged_lion_32bit": "paged Lion",
    "paged_lion_8bit": "paged 8-bit Lion", "rmsprop_bnb": "bitsandbytes' RMSprop", "galore_adamw": "GaLore",
    "galore_adamw_8bit": "8-bit GaLore", "galore_adafactor": "GaLore Adafactor", "lomo": "LOMO", "adalomo": "AdaLomo",
    "grokadamw": "GrokAdamW", "schedule_free_adamw": "schedule-free AdamW", "schedule_free_sgd": "schedule-free SGD",
    "schedule_free_radam": "schedule-free RAdam", "apollo_adamw": "APOLLO", "stable_adamw": "StableAdamW",
}


def optimizer_elsewhere(name: str) -> str | None:
    """The refusal of an optimizer axolotl has and tuneloop does not, naming it and the feature."""
    what = OPTIMIZERS_ELSEWHERE.get(name)
    feature = FEATURES["optimizer_options"][0]
    return None if what is None else f"{what} asks for {feature}, which tuneloop does not do yet"


# dataset `type:` prefixes and names that are preference data (chosen/rejected pairs, rewards)
# (EBFT's strided and multi-turn transforms too: structured EBFT's, ebft_opencode and ebft_reasoning, are built in:
# online_rl/builtin_transforms.py)
PREFERENCE_DATASET_TYPES = ("chat_template.argilla", "bradley_terry", "llama3.ultra", "ebft_strided", "ebft_pretrain",
                            "ebft_chat_multiturn", "ebft_reasoning.transform_strided", "dpo", "kto", "orpo",
                            "chatml.", "llama3.", "user_defined.")


def dataset_type_feature(name: str) -> str:
    """Which feature an unknown dataset type belongs to (preference data has its own)."""
    return "preference" if name.startswith(PREFERENCE_DATASET_TYPES) else "dataset_types"


def _keys(text: str) -> set[str]:
    return set(text.split())


SPEED_OR_LOGGING = _keys("""
    streaming_multipack_buffer_size
    tokenizer_use_fast tokenizer_legacy tokenizer_save_jinja_files experimental_skip_move_to_device use_kernels
    save_safetensors qlora_sharded_model_loading lora_on_cpu merge_lora
    merge_method torchdistx_path
    wandb_watch wandb_log_model hf_mlflow_log_artifacts use_comet
    comet_api_key comet_workspace comet_project_name comet_experiment_key comet_mode comet_online
    comet_experiment_config use_trackio trackio_project_name trackio_run_name trackio_space_id use_otel_metrics
    otel_metrics_host otel_metrics_port gradio_title gradio_share gradio_server_name gradio_server_port
    gradio_max_new_tokens gradio_temperature eval_table_size eval_max_new_tokens s2_attention flash_attn_rms_norm
    strict resize_token_embeddings_to_32x dynamic_checkpoint skip_prepare_dataset num_dataset_shards_to_save
    dataset_keep_in_memory dataloader_pin_memory dataloader_num_workers
    dataloader_prefetch_factor dataloader_drop_last accelerator_config remove_unused_columns push_dataset_to_hub
    hf_use_auth_token device_map ddp_bucket_cap_mb ddp_broadcast_buffers ddp_find_unused_parameters
    do_causal_lm_eval eval_causal_lm_metrics do_bench_eval bench_dataset bench_split gc_steps
    torch_empty_cache_steps gc_collect_steps selective_checkpointing activation_offloading layer_offloading
    sample_packing_group_size sample_packing_bin_size sample_packing_mp_start_method pad_to_multiple_of
    batch_flattening xformers_attention flex_attn_compile_kwargs flash_attn_cross_entropy flash_attn_fuse_mlp
    flash_attn_fuse_qkv flash_optimum sage_attention gemma4_hybrid_attn_impl large_head_attention
    flash_attn_d512 sdpa_varlen fused_attn_kernel experts_implementation lora_mlp_kernel lora_qkv_kernel
    lora_o_kernel lora_embedding_kernel chunked_cross_entropy_num_chunks tiled_mlp
    tiled_mlp_num_shards tiled_mlp_use_original_mlp save_first_step save_only_model heads_k_stride ring_attn_func
    profiler_steps profiler_steps_start
    include_tokens_per_second include_tkps max_memory gpu_memory_limit low_cpu_mem_usage total_num_tokens
    total_supervised_tokens sample_packing_eff_est is_falcon_derived_model is_llama_derived_model
    is_mistral_derived_model is_qwen_derived_model generate_samples num_generation_samples
    generation_max_new_tokens generation_temperature generation_top_p generation_top_k generation_prompt_ratio
    generation_do_sample preprocess_iterable
    cut_cross_entropy use_scattermoe use_sonicmoe use_dsv4_kernels use_glm_dsa_kernels lm_eval_tasks
    lm_eval_batch_size lm_eval_post_train lm_eval_model liger_rope liger_rms_norm liger_rms_norm_gated
    liger_layer_norm liger_swiglu liger_glu_activation liger_cross_entropy liger_fused_linear_cross_entropy
    liger_use_token_scaling use_swanlab swanlab_project swanlab_experiment_name swanlab_description swanlab_mode
    swanlab_workspace swanlab_api_key swanlab_log_model swanlab_web_host swanlab_api_host swanlab_lark_webhook_url
    swanlab_lark_secret swanlab_log_completions swanlab_completion_log_interval swanlab_completion_max_buffer
    unsloth_cross_entropy_loss unsloth_lora_mlp unsloth_lora_qkv unsloth_lora_o unsloth_rms_norm unsloth_rope
    sample_packing_sequentially_mp pretrain_multipack_buffer_size debug log_level
""")

LAUNCHER = _keys("local_rank world_size ddp device axolotl_config_path is_preprocess capabilities env_capabilities")

_REFUSED_BY_FEATURE = {
    "preference": """
        dpo_use_weighting
        dpo_use_liger_kernel dpo_padding_free dpo_generate_during_eval dpo_norm_loss dpo_use_logits_to_keep rpo_alpha
        max_prompt_len
        nemo_gym_enabled nemo_gym_dir nemo_gym_auto_clone nemo_gym_config_paths nemo_gym_head_port
        nemo_gym_server_timeout nemo_gym_verify_timeout nemo_gym_run_timeout nemo_gym_datasets nemo_gym_auto_start
        nemo_gym_model_name nemo_gym_multi_turn nemo_gym_max_turns""",
    "fsdp_deepspeed": """deepcompile""",
    "parallelism": """
        expert_parallel_size expert_parallel_backend expert_parallel_num_nvl_bytes
        expert_parallel_num_rdma_bytes expert_parallel_token_capacity expert_parallel_fallback_on_unsupported""",
    "ray": """use_ray ray_run_name ray_num_workers resources_per_worker""",
    # (processor_type, freeze_mm_modules, processor_kwargs, image_size and image_resize_algorithm are schema fields
    # now: vision-language models, data/images.py)
    "multimodal": "",
    # (dp_shard_size, dp_replicate_size, tensor_parallel_size, context_parallel_size and sequence_parallel_degree
    # are schema fields now: engines/keys.py reads them; heads_k_stride and ring_attn_func tune ring-flash-attn's
    # context parallel, the same attention as the Ulysses exchange tuneloop runs: speed only)
    # (model_quantization_config and its kwargs are schema fields now: Mxfp4Config loads, and other classes are
    # refused there under this feature)
    # (`qat` is a schema field now: int4/int8 QAT through torchao, quant/qat.py; its GPU-only dtypes are refused there)
    "quantization": """
        use_onebitllms gptq quantization fp8
        fp8_enable_fsdp_float8_all_gather gemma4_fp8_nonexpert gemma4_nf4_nonexpert nvfp4_merge_aware
        nvfp4_merge_aware_start_step llmcompressor""",
    "moe": """
        llama4_linearized_experts dense_mixer expert_backend nonexpert_quantization
        moe_grouped_backend moe_dequant_chunk_size moe_bnb_fast dsv4_fp8_nonexpert_mode dsv4_fp8_lora_kernel
        dsv4_shared_mlp_lora_kernel dsv4_bf16_all dsv4_fp4_grouped_mode""",
    # (implemented, so schema fields now: lora_model_dir, lora_fan_in_fan_out, peft_use_dora, peft_use_rslora,
    # peft_init_lora_weights, loraplus_lr_ratio, loraplus_lr_embedding, and `peft` for its LoftQ refusal)
    "peft_variants": """
        lora_rank_pattern lora_alpha_pattern peft_layers_to_transform
        peft_layers_pattern peft_layer_replication
        peft_trainable_token_indices peft_ensure_weight_tying peft_autocast_adapter_dtype mora""",
    "training_methods": """
        relora relora_prune_ratio relora_prune_method relora_cpu_offload relora_steps relora_warmup_steps
        relora_anneal_steps jagged_restart_steps jagged_restart_warmup_steps jagged_restart_anneal_steps
        auto_find_batch_size lisa_n_layers lisa_step_interval lisa_layers_attribute noisy_embedding_alpha
        neftune_noise_alpha use_pose pose_split_on_token_ids pose_max_context_len pose_num_chunks use_eaft
        eaft_alpha eaft_k diffusion hatchery kd_trainer kd_ce_alpha kd_alpha kd_temperature kd_beta
        kd_normalize_topk kd_online_server_base_url kd_online_topk kd_online_server kd_online_timeout
        kd_temperature_min spectrum_top_fraction spectrum_model_name""",
    "pretraining": """
        pretrain_multipack_attn pretraining_sample_concatenation""",
    "data_options": """
        role_boundaries shuffle_before_merging_datasets excess_length_strategy eval_sequence_len
        multipack_real_batches
        chat_template_kwargs default_system_message""",
    "model_options": """
        cls_model_config model_kwargs overrides_of_model_kwargs
        rope_scaling mean_resizing_embeddings shrink_embeddings embeddings_skip_upcast trainer_cls
        fp32_norms fp32_norm_classes scaling_softmax scaling_softmax_factor
        scaling_softmax_bias added_tokens_overrides fix_untrained_tokens""",
    "optimizer_options": """
        embedding_lr embedding_lr_scale optim_args optim_target_modules lr_scheduler_kwargs
        lr_groups adam_epsilon2 adam_beta3 dion_lr dion_momentum dion_rank_fraction
        dion_rank_multiple_of qgalore_rank qgalore_update_proj_gap qgalore_scale qgalore_proj_type
        qgalore_proj_quant qgalore_proj_bits qgalore_proj_group_size qgalore_cos_threshold qgalore_gamma_proj
        qgalore_queue_size grokfast_alpha grokfast_lamb""",
}
REFUSED = {key: feature for feature, text in _REFUSED_BY_FEATURE.items() for key in _keys(text)}

# keys axolotl used to have (old configs still carry them): accepted blank, refused when set
REMOVED = _keys("gptq_groupsize gptq_model_v1 eta_min landmark_attention xpos_rope max_packed_sequence_len "
                "lora_fan_in_fan_out_deprecated")

# dataset-entry keys: the implemented ones are DatasetConfig's fields
DATASET_REFUSED = {key: feature for feature, text in {
    "data_options": """
        input_transform shards shards_idx preprocess_shards conversation input_format field_human field_model
        split_thinking message_field_training message_field_training_detail skip length
        sequence_length min_input_id max_input_id seed train_on_split trust_remote_code""",
    "training_methods": """logprobs_field temperature""",
    "pretraining": """text_column""",
}.items() for key in _keys(text)}

# `plugins:` entries tuneloop accepts: the same maths as without them (kernels), or logging only
SPEED_ONLY_PLUGINS = {
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": "CutCrossEntropy (a fused loss kernel)",
    "axolotl.integrations.liger.LigerPlugin": "Liger (fused kernels)",
    "axolotl.integrations.kernels.KernelsPlugin": "hub kernels",
    "axolotl.integrations.swanlab.SwanLabPlugin": "SwanLab (a tracker)",
}


def refusal(key: str, value, where: str = "") -> str:
    """The message for a refused or removed axolotl key that is set."""
    if key in REMOVED:
        return f"{where}`{key}: {value!r}` is a key axolotl itself has removed; remove it (or leave it blank)"
    feature = REFUSED.get(key) or DATASET_REFUSED.get(key)
    return (f"{where}`{key}: {value!r}` asks for {FEATURES[feature][0]}, which tuneloop does not do yet, and ignoring "
            "it would change what is trained; remove it (or leave it blank)" + ALTERNATIVES.get(feature, ""))


# what to do instead, where there is a way to get what the refused key is for
ALTERNATIVES = {
    "ray": ", and launch the same config with torchrun on each node (`torchrun --nnodes N --nproc-per-node G "
           "--rdzv-backend c10d --rdzv-endpoint FIRST_NODE:29500 -m tuneloop train run.yml`), or on a Slurm cluster "
           "with examples/slurm/train.sbatch",
}
