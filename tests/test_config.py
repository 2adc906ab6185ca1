"""Config: axolotl key names, unknown keys with the nearest name, triage of unimplemented axolotl keys,
value errors naming the key, exclusive keys, --set overrides, exit code 2 without a traceback."""

from __future__ import annotations

import pytest
from conftest import assert_user_error, run_in_process, write_config

from tuneloop.config import config_from_dict
from tuneloop.errors import UserError

MINIMAL = {"base_model": "some/model", "datasets": [{"path": "data.jsonl", "type": "alpaca"}]}


def config(**keys):
    return config_from_dict({**MINIMAL, **keys})


def error_of(**keys) -> str:
    with pytest.raises(UserError) as caught:
        config(**keys)
    return str(caught.value)


def test_axolotl_keys_are_read_with_their_defaults():
    cfg = config(sequence_len=512, micro_batch_size=2, gradient_accumulation_steps=4, num_epochs=3,
                 learning_rate=1e-4, lr_scheduler="linear", warmup_ratio=0.05, optimizer="adamw_torch_fused",
                 bf16="auto", val_set_size=0.05, train_on_inputs=True, special_tokens={"pad_token": "<pad>"})
    assert (cfg.sequence_len, cfg.micro_batch_size, cfg.gradient_accumulation_steps) == (512, 2, 4)
    assert cfg.optimizer == "adamw_torch_fused" and cfg.bf16 == "auto" and cfg.train_on_inputs
    assert config().trust_remote_code is False


def test_unknown_key_names_the_nearest_known_key():
    message = error_of(learning_rat=1e-4)
    assert "unknown key `learning_rat`" in message and "Did you mean `learning_rate`?" in message
    message = error_of(gradient_acumulation_steps=2)
    assert "`gradient_accumulation_steps`" in message


def test_unknown_key_inside_a_dataset_entry_is_named_with_its_place():
    with pytest.raises(UserError, match=r"datasets\[0\]\.`data_file`.*`data_files`"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x", "data_file": "y"}]})


def test_result_changing_axolotl_key_is_an_error_when_set_and_fine_when_empty():
    assert "would change what is trained" in error_of(neftune_noise_alpha=5)
    config(neftune_noise_alpha=None, load_in_8bit=False)  # empty or false: accepted


def test_speed_only_axolotl_key_is_a_warning():
    with pytest.warns(UserWarning, match="flash_attn_rms_norm.*only affects speed"):
        config(flash_attn_rms_norm=True)


def test_axolotls_bf16_full_trains_in_bf16_and_says_what_it_leaves():
    with pytest.warns(UserWarning, match="`bf16: full` is read as `bf16: true`.*bf16_full_eval.*eval speed and memory"):
        assert config(bf16="full").bf16 is True
    assert "`bf16`" in error_of(bf16="half")  # any other word is still refused, naming the key


def test_wrong_type_or_value_names_the_key_and_what_is_allowed():
    assert "`micro_batch_size`" in error_of(micro_batch_size="two")
    message = error_of(lr_scheduler="cyclic")
    assert "`lr_scheduler`" in message and "'cosine'" in message
    assert "`sequence_len` must be at least 1" in error_of(sequence_len=0)
    assert "`datasets.0.type`" in error_of(datasets=[{"path": "x", "type": "oasst"}])
    assert "`base_model` is required" in str(pytest.raises(UserError, config_from_dict, {"datasets": []}).value)


@pytest.mark.parametrize("first,second", [("warmup_steps", "warmup_ratio"), ("eval_steps", "evals_per_epoch"),
                                          ("save_steps", "saves_per_epoch")])
def test_mutually_exclusive_keys(first, second):
    values = {"warmup_steps": 10, "warmup_ratio": 0.1, "eval_steps": 5, "evals_per_epoch": 2, "save_steps": 5,
              "saves_per_epoch": 2}
    message = error_of(**{first: values[first], second: values[second]})
    assert f"`{first}` and `{second}` cannot both be set" in message


def test_batch_size_must_agree_with_micro_batch_accumulation_and_world_size():
    cfg = config(batch_size=16, micro_batch_size=2, gradient_accumulation_steps=4)
    cfg.check_batch_size(world_size=2)  # 2 × 4 × 2 = 16
    with pytest.raises(UserError, match=r"batch_size: 16.*2 × 4 × 1 = 8"):
        cfg.check_batch_size(world_size=1)


def test_set_overrides_any_key_parsed_as_yaml():
    cfg = config_from_dict(MINIMAL, ["learning_rate=3e-4", "datasets.0.type=completion", "sample_packing=true"])
    assert cfg.learning_rate == 3e-4 and cfg.datasets[0].type == "completion" and cfg.sample_packing is True
    with pytest.raises(UserError, match="unknown key `learnin_rate`"):
        config_from_dict(MINIMAL, ["learnin_rate=1"])


def test_an_unquoted_no_strategy_is_no_as_in_yaml_files_people_write():
    """`save_strategy: no` and `--set save_strategy=no` reach the schema as YAML's false."""
    assert config_from_dict({**MINIMAL, "save_strategy": False, "eval_strategy": False}).save_strategy == "no"
    assert config_from_dict(MINIMAL, ["eval_strategy=no"]).eval_strategy == "no"


def test_cli_user_error_exits_2_with_one_message_and_no_traceback(tmp_path):
    path = write_config(tmp_path / "bad.yml", **MINIMAL, micro_batch_sise=2)
    result = run_in_process("plan", str(path))  # (the process's exit code is main's: `sys.exit(main())`)
    assert_user_error(result, "unknown key `micro_batch_sise`", "`micro_batch_size`")
    assert_user_error(run_in_process("train", str(tmp_path / "nope.yml")), "no such file")
    assert_user_error(run_in_process("plan", str(path), "--set", "novalue"), "expected KEY=VALUE")


def test_keys_that_would_be_half_obeyed_are_refused():
    assert "`shuffle_merged_datasets` false is not supported" in error_of(shuffle_merged_datasets=False)
    assert "`save_strategy: epoch` and `save_steps` disagree" in error_of(save_strategy="epoch", save_steps=10)
    assert "`eval_steps` must be a whole number" in error_of(eval_steps=0)
    assert "`save_steps` must be a whole number" in error_of(save_steps=2.5)
    assert "would change what is trained" in error_of(datasets=[{"path": "x", "shards": 4}])
    assert config(eval_steps=0.25).eval_steps == 0.25 and config(save_steps=5.0).save_steps == 5


def test_bad_set_values_are_clear_errors():
    with pytest.raises(UserError, match="not valid YAML"):
        config_from_dict(MINIMAL, ["micro_batch_size=[1,"])
    with pytest.raises(UserError, match=r"`datasets` is a list of 1 entry, and `3` is not an index of it"):
        config_from_dict(MINIMAL, ["datasets.3=1"])


def test_a_validated_config_says_what_the_user_wrote_and_resolved_decides_what_the_run_does():
    """The sharding keys write no other key: FSDP's activation_checkpointing turns checkpointing on, a sharding engine
    leaves torch.compile off and rank 0's loading is left off beside `rl`, in Resolved alone (the plan shows it);
    what is left off is still said when the config is read."""
    from tuneloop.resolved import resolve_config

    fsdp = {"fsdp_version": 2, "fsdp_config": {"activation_checkpointing": True, "cpu_ram_efficient_loading": True}}
    with pytest.warns(UserWarning, match="`torch_compile` with fsdp2"):
        cfg = config(torch_compile=True, **fsdp)
    assert cfg.torch_compile is True and cfg.gradient_checkpointing is False and not hasattr(cfg, "engine")
    resolved = resolve_config(cfg)
    assert resolved.engine.name == "fsdp2" and resolved.engine.loads_on_rank_zero
    assert (resolved.compiled, resolved.compile_auto, resolved.gradient_checkpointing) == (False, False, True)
    assert resolved.to_json()["gradient_checkpointing"] is True and resolved.to_json()["compile_auto"] is False
    plain = resolve_config(config(gradient_checkpointing="offload"))
    assert (plain.compiled, plain.compile_auto, plain.gradient_checkpointing) == (False, True, "offload")
    assert resolve_config(config(torch_compile=True)).compiled is True
    assert resolve_config(config(torch_compile="auto", context_parallel_size=2)).compile_auto is False


def test_the_mixed_precision_of_the_keys_is_one_pure_function():
    from tuneloop.host.hardware import mixed_precision

    assert mixed_precision(True, "auto", None) == ("fp16", "fp16: true")
    assert mixed_precision(None, "auto", "the CPU has AMX") == ("bf16", "bf16: auto, and the CPU has AMX")
    assert mixed_precision(None, "auto", None)[0] == "no"
    assert mixed_precision(None, True, None) == ("bf16", "bf16: true")
    assert mixed_precision(None, False, "the CPU has AMX") == ("no", "bf16: false")
