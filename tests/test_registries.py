"""Registries: a capability is one entry, and everything that needs to know about it reads the entry.

The unknown-name errors list exactly the registered names; every registered optimizer builds and has a
memory figure; every scheduler runs a whole plan; an optimizer that needs a GPU is refused before training;
and the run state survives a checkpoint whole (a counter added to it cannot be saved and forgotten)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tuneloop.config import config_from_dict
from tuneloop.data.formats import FORMATS
from tuneloop.dpo_loss_types import DPO_LOSS_TYPES
from tuneloop.errors import UserError
from tuneloop.host.hardware import check_hardware
from tuneloop.online_rl.loss_types import LOSS_TYPES
from tuneloop.optim import OPTIMIZERS, SCHEDULERS, OptimizerKind, build_optimizer, build_scheduler
from tuneloop.registry import Registry
from tuneloop.resolved import resolve_config
from tuneloop.rl_methods import RL_METHODS
from tuneloop.train.state import RunState
from tuneloop.use.exporters import EXPORTERS, Exporter

MINIMAL = {"base_model": "m", "datasets": [{"path": "x"}]}


def error_of(raw: dict) -> str:
    with pytest.raises(UserError) as caught:
        config_from_dict(raw)
    return str(caught.value)


@pytest.mark.parametrize("key, registry", [("optimizer", OPTIMIZERS), ("lr_scheduler", SCHEDULERS)])
def test_an_unknown_name_is_refused_with_the_registrys_own_list(key, registry):
    message = error_of({**MINIMAL, key: "no_such_thing"})
    assert f"`{key}` got 'no_such_thing'" in message
    assert all(repr(name) in message for name in registry.names())


def test_an_unknown_dataset_type_lists_the_registered_formats():
    message = error_of({"base_model": "m", "datasets": [{"path": "x", "type": "no_such_format"}]})
    assert "unknown dataset type 'no_such_format'" in message
    assert all(repr(name) in message for name in FORMATS.names())


def test_aliases_answer_for_their_entry_and_a_name_cannot_be_taken_twice():
    table: Registry[str] = Registry("thing", "thing")
    table.add("alpaca", "renderer", aliases=("alpaca:chat",))
    assert table["alpaca:chat"] == "renderer" and table.canonical("alpaca:chat") == "alpaca"
    assert table.names() == ["alpaca", "alpaca:chat"]
    with pytest.raises(ValueError, match="registered twice"):
        table.add("other", "x", aliases=("alpaca",))


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_every_optimizer_builds_or_is_refused_and_the_memory_estimate_knows_its_state(name, tiny_model_dir):
    from tuneloop.model.kinds import MODEL_KINDS
    from tuneloop.plan.model_facts import model_facts
    from tuneloop.plan.memory import estimate_memory

    cfg = config_from_dict({**MINIMAL, "base_model": str(tiny_model_dir), "optimizer": name})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained = sum(p.numel() for p in model.parameters())
    estimate = estimate_memory(cfg, model_facts(cfg, MODEL_KINDS["causal"]), tokens_per_micro_batch=64,
                               precision="no", engine=resolve_config(cfg).engine)
    assert estimate.optimizer_gb == round(trained * OPTIMIZERS[name].state_bytes_per_param / 1e9, 3)
    if OPTIMIZERS[name].needs_cuda and not torch.cuda.is_available():
        with pytest.raises(UserError, match=f"`optimizer: {name}` needs a CUDA GPU"):
            check_hardware(cfg, resolve_config(cfg))  # what `train` does before loading anything
        return
    check_hardware(cfg, resolve_config(cfg))
    optimizer = build_optimizer(cfg, model)
    model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    optimizer.step()


class Plan:
    def __init__(self, warmup_steps: int, total_steps: int):
        self.warmup_steps, self.total_steps = warmup_steps, total_steps


@pytest.mark.parametrize("name", SCHEDULERS.names())
def test_every_scheduler_runs_a_whole_plan_with_finite_positive_rates(name):
    cfg = config_from_dict({**MINIMAL, "lr_scheduler": name, "learning_rate": 1e-3})
    parameter = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([parameter], lr=cfg.learning_rate)
    scheduler = build_scheduler(cfg, Plan(warmup_steps=3, total_steps=20), optimizer)
    rates = []
    for _ in range(20):  # the loop steps the scheduler once per optimizer step, total_steps times
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert all(math.isfinite(rate) and 0 < rate <= cfg.learning_rate * (1 + 1e-9) for rate in rates)
    assert max(rates) == pytest.approx(cfg.learning_rate, rel=0.2)


def test_an_optimizer_that_needs_a_gpu_is_refused_on_a_machine_without_one(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    gpu_only = OptimizerKind(build=lambda groups, cfg: None, state_bytes_per_param=2, needs_cuda=True)
    monkeypatch.setitem(OPTIMIZERS._entries, "gpu_only_test", gpu_only)
    monkeypatch.setitem(OPTIMIZERS._canonical, "gpu_only_test", "gpu_only_test")
    cfg = config_from_dict({**MINIMAL, "optimizer": "gpu_only_test"})
    with pytest.raises(UserError, match="`optimizer: gpu_only_test` needs a CUDA GPU"):
        check_hardware(cfg, resolve_config(cfg))


def test_the_run_state_survives_a_checkpoint_whole():
    """Every field, set away from its default, comes back from the checkpoint's JSON: a counter added to
    RunState and forgotten in to_json/from_json fails here."""
    state = RunState(step=7, tokens_seen=1234, targets_collated=600,
                     evals=[{"step": 4, "eval_loss": 2.5}, {"step": 7, "eval_loss": 2.75}],
                     best_metric=2.5, best_step=4, evals_without_improvement=1, bad_steps_in_a_row=[0, 2])
    defaults = RunState()
    for field in dataclasses.fields(RunState):
        assert getattr(state, field.name) != getattr(defaults, field.name), f"set {field.name} in this test"
    saved = state.to_json(targets_per_rank=[600, 634], streaks_per_rank=[[0, 2], [1, 0]])
    assert RunState.from_json(saved, rank=0, world_size=2) == state
    assert RunState.from_json(saved, rank=1, world_size=2).targets_collated == 634
    assert RunState.from_json(saved, rank=1, world_size=2).bad_steps_in_a_row == [1, 0]
    # a forced resume on another number of ranks cannot split the per-rank counts: they restart at 0,
    # while the watchdog keeps the longest streak any old rank had
    alone = RunState.from_json(saved, rank=0, world_size=1)
    assert alone.targets_collated == 0 and alone.bad_steps_in_a_row == [1, 2]


# ---- every name of every registry is reachable end to end ------------------------------------------------------
# A name added to a registry without what it needs elsewhere (a loss for an RL method, an example row for a format,
# keys that reach an engine) fails here, not at a user's first step. Each table below is keyed by the registry's
# names: a new name without an entry fails too, asking for its test.

FORMAT_EXAMPLES = {
    "alpaca": {"instruction": "Add two numbers.", "input": "one two", "output": "three"},
    "alpaca:chat": {"instruction": "Name three colours.", "output": "red, green and blue"},
    "alpaca:chatml": {"instruction": "Name three colours.", "output": "red, green and blue"},
    "alpaca:phi": {"instruction": "Add two numbers.", "input": "one two", "output": "three"},
    **{name: {"question": "It orbits the Earth", "category": "SPACE", "answer": "the Moon"}
       for name in ("jeopardy", "jeopardy:chat", "jeopardy:chatml", "jeopardy:phi")},
    "completion": {"text": "The quick brown fox jumps over the lazy dog."},
    "seq2seq": {"source": "Translate the sentence into French.", "target": "red, green and blue"},
    "chat_template": {"messages": [{"role": "user", "content": "Hello there"},
                                   {"role": "assistant", "content": "I am fine, thank you."}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "Hello there"},
                                   {"from": "gpt", "value": "I am fine, thank you."}]},
}


def test_the_registries_name_exactly_the_things_their_tests_reach():
    from tuneloop.data.chat_templates import CHAT_TEMPLATES
    from tuneloop.engines.keys import ENGINES
    from tuneloop.model.kinds import MODEL_KINDS
    from tuneloop.trackers import TRACKERS
    from tuneloop.train.objectives import OBJECTIVES
    from tuneloop.train.preference import LOSSES

    canonical = {FORMATS.canonical(name) for name in FORMATS.names()}
    assert canonical == set(FORMAT_EXAMPLES)
    from tuneloop.rl_methods import ONLINE_METHODS, PROCESS_REWARD_OBJECTIVE, REWARD_MODEL_OBJECTIVE

    # (the reward models': test_reward_model.py, test_process_reward_model.py)
    assert set(RL_METHODS.names()) == set(LOSSES.names()) == set(OBJECTIVES.names()) - {
        "language_model", *ONLINE_METHODS, REWARD_MODEL_OBJECTIVE, PROCESS_REWARD_OBJECTIVE}
    assert set(ONLINE_METHODS) <= set(OBJECTIVES.names())
    # every GRPO loss type is compared with TRL's (test_grpo_equivalence.py names them all)
    equivalence = (Path(__file__).parent / "test_grpo_equivalence.py").read_text()
    assert all(f'("{name}", ' in equivalence for name in LOSS_TYPES.names())
    # every DPO loss type is one a DPO method accepts (and walked below)
    assert {name for method in RL_METHODS.names() for name in RL_METHODS[method].loss_types} == \
        set(DPO_LOSS_TYPES.names())
    assert set(ENGINES.names()) == set(ENGINE_KEYS)
    assert set(TRACKERS.names()) == set(TRACKER_KEYS)
    assert set(MODEL_KINDS.names()) == {"causal", "seq2seq", "sequence_classification", "token_classification",
                                       "vision_language"}
    assert CHAT_TEMPLATES.names()  # (walked one by one below)
    assert set(EXPORTERS.names()) == set(EXPORT_QUANTS)


@pytest.mark.parametrize("name", FORMATS.names())
def test_every_dataset_format_prepares_a_row_with_trained_tokens(tmp_path, tiny_tokenizer_dir, name):
    from transformers import AutoTokenizer

    from conftest import write_jsonl
    from tuneloop.data.prepare import prepare

    canonical = FORMATS.canonical(name)
    data = write_jsonl(tmp_path / "rows.jsonl", [FORMAT_EXAMPLES[canonical]] * 2)
    entry = {"path": str(data), "type": name, **({"field": "text"} if canonical == "completion" else {})}
    cfg = config_from_dict({"base_model": "m", "datasets": [entry], "sequence_len": 256,
                            "dataset_prepared_path": str(tmp_path / "prepared")})
    prepared = prepare(cfg, AutoTokenizer.from_pretrained(tiny_tokenizer_dir),
                       encoder_decoder=canonical == "seq2seq")
    assert prepared.stats.train_rows == 2 and prepared.train[0]["n_targets"] > 0


def chat_template_names() -> list[str]:
    from tuneloop.data.chat_templates import CHAT_TEMPLATES

    return CHAT_TEMPLATES.names()


@pytest.mark.parametrize("name", chat_template_names())
def test_every_chat_template_trains_the_reply_and_not_the_prompt(tmp_path, tiny_tokenizer_dir, name):
    from transformers import AutoTokenizer

    from conftest import write_jsonl
    from tuneloop.data.labels import IGNORE_INDEX
    from tuneloop.data.prepare import prepare

    data = write_jsonl(tmp_path / "rows.jsonl", [FORMAT_EXAMPLES["chat_template"]])
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": str(data), "type": "chat_template"}],
                            "chat_template": name, "sequence_len": 4096,  # (Command A: a 2.4k-character preamble)
                            "dataset_prepared_path": str(tmp_path / "prepared")})
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    row = prepare(cfg, tokenizer, encoder_decoder=False).train[0]
    trained = tokenizer.decode([token for token, label in zip(row["input_ids"], row["labels"])
                                if label != IGNORE_INDEX])
    assert "I am fine, thank you." in trained and "Hello there" not in trained


def preference_rows(paired: bool) -> list[dict]:
    prompt = [{"role": "user", "content": "Name three colours."}]
    if paired:
        return [{"messages": prompt, "chosen": "red, green and blue", "rejected": "one two three"}] * 4
    return [{"prompt": prompt, "completion": reply, "label": label}
            for reply, label in (("red, green and blue", True), ("one two three", False))] * 2


def preference_loss_and_gradient(tmp_path, model_dir, paired: bool, **keys):
    """One micro-batch (a pair, or two labelled rows) of a preference config through its objective: (the loss, its
    stats, the model after backward)."""
    from transformers import AutoTokenizer

    from conftest import write_jsonl
    from tuneloop.data.collate import Collator
    from tuneloop.data.prepare import prepare
    from tuneloop.train.objectives import ObjectiveModule, objective_of

    data = write_jsonl(tmp_path / "rows.jsonl", preference_rows(paired))
    cfg = config_from_dict({"base_model": str(model_dir), "sequence_len": 256,
                            "datasets": [{"path": str(data), "type": "chat_template"}],
                            "dataset_prepared_path": str(tmp_path / "prepared"), **keys})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    store = prepare(cfg, tokenizer, encoder_decoder=False).train
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir) if RL_METHODS[cfg.rl].uses_reference else None
    batch = Collator(store, tokenizer.pad_token_id, packed=False)([[0], [1]])
    loss, stats = ObjectiveModule(model, objective_of(cfg, reference))(batch.inputs, batch.targets, batch.extra)
    loss.backward()
    return loss, stats, model


def assert_finite_and_trains(loss, stats, model):
    assert torch.isfinite(loss) and torch.isfinite(stats).all()
    assert any(param.grad is not None and param.grad.abs().sum() > 0 for param in model.parameters())


@pytest.mark.parametrize("name", RL_METHODS.names())
def test_every_preference_method_reaches_a_finite_loss_through_its_objective(tmp_path, tiny_model_dir, name):
    assert_finite_and_trains(*preference_loss_and_gradient(tmp_path, tiny_model_dir, RL_METHODS[name].paired,
                                                           rl=name))


@pytest.mark.parametrize("name", DPO_LOSS_TYPES.names())
def test_every_dpo_loss_type_reaches_a_finite_loss_through_its_objective(tmp_path, tiny_model_dir, name):
    method = next(method for method in RL_METHODS.names() if name in RL_METHODS[method].loss_types)
    assert_finite_and_trains(*preference_loss_and_gradient(tmp_path, tiny_model_dir, RL_METHODS[method].paired,
                                                           rl=method, dpo_loss_type=name))


def grpo_keys(loss_type: str) -> dict:
    return {**MINIMAL, "rl": "grpo", "micro_batch_size": 4,
            "trl": {"loss_type": loss_type, "beta": 0.1, "num_generations": 2, "max_completion_length": 6,
                    "reward_funcs": ["rewards.unused"]}}  # (imported only when a run starts)


@pytest.mark.parametrize("name", LOSS_TYPES.names())
def test_every_grpo_loss_type_reaches_a_finite_loss_through_its_objective(tiny_model_dir, name):
    """Four completions (two prompts' groups of two, one truncated) with moved old and reference log-probs, so
    that ratios, clipping and the KL term all take part; the objective's unit is the loss type's."""
    from transformers import AutoTokenizer

    from tuneloop.log_probs import token_log_probs
    from tuneloop.online_rl.rollout import Completions, completion_rows
    from tuneloop.train.objectives import ObjectiveModule, objective_of

    cfg = config_from_dict({**grpo_keys(name), "base_model": str(tiny_model_dir)})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [tokenizer("the cat sat")["input_ids"]] * 2 + [tokenizer("a dog ran")["input_ids"]] * 2
    tokens = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32], [41, 42, 43, 44]]
    made = Completions(prompts, tokens, [len(t) for t in tokens], [len(t) == 6 for t in tokens])
    inputs, targets, extra = completion_rows(made, 0, len(tokens), tokenizer.pad_token_id)
    with torch.no_grad():
        current = token_log_probs(model, inputs, targets, cfg.trl_settings.temperature)[0]
    noise = torch.Generator().manual_seed(5)
    extra.update(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), rewards=torch.zeros(4, 1),
                 total_reward=torch.zeros(4), zero_std=torch.zeros(4, dtype=torch.bool),
                 truncated=torch.tensor(made.truncated),
                 old_log_probs=current + 0.3 * torch.randn(current.shape, generator=noise),
                 reference_log_probs=current + 0.5 * torch.randn(current.shape, generator=noise))
    objective = objective_of(cfg)
    assert objective.unit == LOSS_TYPES[name].unit
    loss, stats = ObjectiveModule(model, objective)(inputs, targets, extra)
    loss.backward()
    assert_finite_and_trains(loss, stats, model)
    line = objective.summarise(stats.tolist(), 4)
    assert ("clip_ratio" in line) == LOSS_TYPES[name].clips and math.isfinite(line["kl"])


# ---- the config accepts exactly the loss types its table names -------------------------------------------------

PAIRS = {**MINIMAL, "datasets": [{"path": "x", "type": "chat_template"}]}


def added_to(registry: Registry, name: str, entry, monkeypatch) -> None:
    monkeypatch.setitem(registry._entries, name, entry)
    monkeypatch.setitem(registry._canonical, name, name)


def test_dpo_accepts_exactly_the_loss_types_of_its_table(monkeypatch):
    assert RL_METHODS["dpo"].loss_types == tuple(DPO_LOSS_TYPES.names())
    for name in DPO_LOSS_TYPES.names():
        assert config_from_dict({**PAIRS, "rl": "dpo", "dpo_loss_type": name}).dpo_loss_type == [name]
    message = error_of({**PAIRS, "rl": "dpo", "dpo_loss_type": "new_loss"})
    assert f"`dpo_loss_type: new_loss` is not a loss of `rl: dpo` ({', '.join(DPO_LOSS_TYPES.names())})" in message
    added_to(DPO_LOSS_TYPES, "new_loss", DPO_LOSS_TYPES["hinge"], monkeypatch)  # one table entry is all it takes
    assert config_from_dict({**PAIRS, "rl": "dpo", "dpo_loss_type": "new_loss"}).dpo_loss_type == ["new_loss"]
    assert "`dpo_loss_type: hinge` is not a loss of `rl: ipo` (ipo)" in error_of(
        {**PAIRS, "rl": "ipo", "dpo_loss_type": "hinge"})  # (`rl: ipo` is DPO with the IPO loss alone)


def test_grpo_accepts_exactly_the_loss_types_of_its_table(monkeypatch):
    for name in LOSS_TYPES.names():
        assert config_from_dict(grpo_keys(name)).trl_settings.unit == LOSS_TYPES[name].unit
    message = error_of(grpo_keys("new_loss"))
    assert f"got 'new_loss'; TRL's GRPO losses are {', '.join(LOSS_TYPES.names())}" in message
    added_to(LOSS_TYPES, "new_loss", LOSS_TYPES["dapo"], monkeypatch)
    assert config_from_dict(grpo_keys("new_loss")).trl_settings.unit == LOSS_TYPES["dapo"].unit


ENGINE_KEYS = {
    "ddp": {},
    "fsdp2": {"fsdp": ["full_shard"], "fsdp_version": 2},
    "deepspeed": {"deepspeed": "zero2"},
}


@pytest.mark.parametrize("name", ENGINE_KEYS)
def test_every_engine_is_reached_by_its_keys_and_describes_its_share(name):
    from tuneloop.engines.base import Engine, WholeBytes
    from tuneloop.resolved import resolve_config

    cfg = config_from_dict({**MINIMAL, **ENGINE_KEYS[name]})
    spec = resolve_config(cfg).engine
    assert spec.name == name and spec.describe(2)
    whole = WholeBytes(weights=8e6, gradients=8e6, optimizer=16e6, parameters=2_000_000, trainable=2_000_000,
                       weight_bytes=4, layer_parameters=400_000, layers=4)
    share = spec.per_rank(whole, world_size=2, accumulation=1, precision="no")
    held = share.weights + share.gradients + share.optimizer
    whole_copy = whole.weights + whole.gradients + whole.optimizer
    assert held == whole_copy if name == "ddp" else held < whole_copy  # (a sharding engine divides over 2 ranks)
    assert isinstance(spec.build(cfg, plan=None, accelerator=None), Engine)


TRACKER_KEYS = {
    "tensorboard": {"use_tensorboard": True},
    "wandb": {"wandb_project": "p", "wandb_mode": "offline"},
    "mlflow": {"mlflow_experiment_name": "e"},
}


@pytest.mark.parametrize("name", TRACKER_KEYS)
def test_every_tracker_is_wanted_by_its_keys_alone(name):
    from tuneloop.trackers import wanted_trackers

    assert wanted_trackers(config_from_dict({**MINIMAL, **TRACKER_KEYS[name]})) == [name]


# ---- export formats: `tuneloop export` reads its choices, file suffix and closing lines from EXPORTERS --------------

EXPORT_QUANTS = {"gguf": "f16"}  # a quantization each format's walk writes (test_export.py walks every one of GGUF's)


@pytest.mark.parametrize("name", EXPORTERS.names())
def test_every_export_format_writes_its_file_through_the_command(name, tiny_model_dir, tmp_path):
    from conftest import run_in_process

    exporter = EXPORTERS[name]
    output = tmp_path / f"model{exporter.suffix}"
    done = run_in_process("export", "--model", str(tiny_model_dir), "--format", name, "--quant", EXPORT_QUANTS[name],
                          "--output", str(output))
    assert done.returncode == 0, done.stderr[-2000:]
    assert output.is_file() and output.stat().st_size > 0 and str(output) in done.stdout  # (its closing lines)


def test_the_export_command_knows_no_format_but_the_registrys(tiny_model_dir, tmp_path, monkeypatch):
    """A format added to EXPORTERS is offered, written, named by its suffix and followed by its own lines; a name
    that is not a format, or a --quant that is not the format's, is refused listing the registry's names."""
    from conftest import assert_user_error, run_in_process

    written = []

    def write(folder, output, quant, **options):  # (writes nothing: the output would be in the shared model folder)
        written.append((output, quant, options["overwrite"]))
        return output

    quants: Registry[str] = Registry("test quantization", "--quant")
    quants.add("x1", "x1")
    quants.add("x2", "x2")
    fake = Exporter(summary="a test file", suffix=".test", readers="nobody", quantizations=quants, default_quant="x2",
                    default_quant_note="the test's", quant_note="nothing else", write=write,
                    hints=lambda output: [f"wrote {output}", "run it with: cat"])
    added_to(EXPORTERS, "test_format", fake, monkeypatch)

    listed = " ".join(run_in_process("export", "--help").stdout.split())
    assert "test_format: a test file" in listed and "test_format: x2 (the default: the test's), x1; nothing" in listed
    done = run_in_process("export", "--model", str(tiny_model_dir), "--format", "test_format")
    assert done.returncode == 0, done.stderr[-2000:]
    assert written == [(tiny_model_dir / "model-x2.test", "x2", False)]
    assert done.stdout.splitlines() == [f"wrote {tiny_model_dir / 'model-x2.test'}", "run it with: cat"]
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--format", "test_format",
                                     "--output", str(tmp_path / "m.gguf")), "does not end in .test", "nobody")
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--format", "test_format",
                                     "--quant", "q8_0"), "--quant q8_0 is not one of --format test_format's: 'x1' or 'x2'")
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--format", "onnx"),
                      "--format", "onnx", *EXPORTERS.names())
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--quant", "q2_k"),
                      "--quant", "q2_k", *EXPORTERS["gguf"].quantizations.names())
