"""axolotl's LoRA variants (DoRA, rsLoRA, the start of A and B, fan-in-fan-out weights, LoRA+, continuing from an
adapter folder): each changes one optimizer step the way peft's own code does, and differs from plain LoRA where the
variant means it to. The equality tests build the same tiny model twice from one seed, once through tuneloop
(adapters.add_adapter, optim.build_optimizer) and once through peft directly, and take one identical AdamW step."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from conftest import assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl

SEED = 3
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture
def alpaca_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", tiny_rows(40))


def config_of(model_dir, **keys):
    from tuneloop.config import config_from_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_from_dict({"base_model": str(model_dir), "datasets": [{"path": "x.jsonl", "type": "alpaca"}],
                                 "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": TARGETS,
                                 "optimizer": "adamw_torch", "learning_rate": LR, "bf16": False, **keys})


def fresh_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def one_step(model, optimizer) -> torch.Tensor:
    """One AdamW step on a fixed row; the logits after it (what the update changed)."""
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def tuneloop_step(model_dir, **keys):
    """(logits after one step, trained parameters by name) through tuneloop's adapter and optimizer."""
    from tuneloop.adapters import add_adapter
    from tuneloop.optim import build_optimizer

    cfg = config_of(model_dir, **keys)
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = add_adapter(cfg, fresh_model(model_dir), "CAUSAL_LM")
    logits = one_step(model, build_optimizer(cfg, model))
    return logits, trained(model)


def peft_step(model_dir, optimizer_of=None, **lora_keys):
    """The same through peft alone: get_peft_model with this LoraConfig, torch's AdamW (or `optimizer_of(model)`)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(fresh_model(model_dir), LoraConfig(
            r=4, lora_alpha=8, target_modules=lora_keys.pop("target_modules", TARGETS), task_type="CAUSAL_LM",
            **lora_keys))
    optimizer = (optimizer_of(model) if optimizer_of else
                 torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0))
    return one_step(model, optimizer), trained(model)


def trained(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}


def assert_same_step(ours, theirs):
    (logits, weights), (peft_logits, peft_weights) = ours, theirs
    assert weights.keys() == peft_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], peft_weights[name], rtol=0, atol=1e-7, msg=name)
    torch.testing.assert_close(logits, peft_logits, rtol=0, atol=1e-6)


def relative_change(logits, other) -> float:
    return float((logits - other).abs().max() / other.abs().max())


@pytest.fixture(scope="module")
def plain_lora(tiny_model_dir):
    return tuneloop_step(tiny_model_dir)


def test_plain_lora_is_peft_s_lora(tiny_model_dir, plain_lora):
    """The harness itself: with no variant, tuneloop's step is peft's (so the differences below are the variants')."""
    assert_same_step(plain_lora, peft_step(tiny_model_dir))


def test_dora_adds_magnitudes_and_steps_as_peft_s_dora(tiny_model_dir, plain_lora):
    ours = tuneloop_step(tiny_model_dir, peft_use_dora=True)
    assert_same_step(ours, peft_step(tiny_model_dir, use_dora=True))
    magnitudes = [name for name in ours[1] if "lora_magnitude_vector" in name]
    assert len(magnitudes) == 4  # q_proj and v_proj of 2 layers: one per output feature each
    assert relative_change(ours[0], plain_lora[0]) > 1e-2  # (measured: 0.062 of the largest logit)


def test_rslora_scales_by_the_root_of_the_rank_as_peft(tiny_model_dir, plain_lora):
    ours = tuneloop_step(tiny_model_dir, peft_use_rslora=True)
    assert_same_step(ours, peft_step(tiny_model_dir, use_rslora=True))
    # alpha/sqrt(r) = 4 against alpha/r = 2: AdamW's first step is about lr per entry whatever the gradient's
    # scale, so B moves about as far (within 1% of the step) and the output changes about twice as much
    for name, weight in ours[1].items():
        torch.testing.assert_close(weight, plain_lora[1][name], rtol=0, atol=LR / 100)
    assert relative_change(ours[0], plain_lora[0]) > 0.1  # (measured: 0.28)


@pytest.mark.parametrize("init", ["gaussian", "orthogonal", "mica", False])
def test_each_init_of_lora_weights_starts_as_peft_s(tiny_model_dir, plain_lora, init):
    ours = tuneloop_step(tiny_model_dir, peft_init_lora_weights=init)
    assert_same_step(ours, peft_step(tiny_model_dir, init_lora_weights=init))
    assert relative_change(ours[0], plain_lora[0]) > 0.1  # (measured: 0.51 to 1.17)


def loraplus_reference(ratio, weight_decay=0.0, embedding_rate=1e-6):
    """peft's own LoRA+ optimizer (torch's AdamW), as a function of the model."""
    from peft.optimizers import create_loraplus_optimizer

    return lambda model: create_loraplus_optimizer(
        model, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=ratio, loraplus_weight_decay=weight_decay,
        loraplus_lr_embedding=embedding_rate, betas=BETAS, eps=EPS)


def test_loraplus_groups_step_as_peft_s_loraplus_optimizer(tiny_model_dir):
    """B matrices at 16 × the rate, the embedding's LoRA at loraplus_lr_embedding, weight decay on matrices (peft
    decays them all by loraplus_weight_decay: the same here, where every trained parameter is a matrix)."""
    targets = [*TARGETS, "embed_tokens"]
    ours = tuneloop_step(tiny_model_dir, loraplus_lr_ratio=16, loraplus_lr_embedding=1e-3, weight_decay=0.1,
                         lora_target_modules=targets)
    theirs = peft_step(tiny_model_dir, optimizer_of=loraplus_reference(16, 0.1, 1e-3), target_modules=targets)
    assert_same_step(ours, theirs)


def test_loraplus_moves_b_faster_than_plain_lora(tiny_model_dir, plain_lora):
    ours = tuneloop_step(tiny_model_dir, loraplus_lr_ratio=16)
    assert_same_step(ours, peft_step(tiny_model_dir, optimizer_of=loraplus_reference(16)))
    for name, weight in ours[1].items():
        if "lora_B" in name:  # B starts at 0 and AdamW's first step is about lr per entry: 16 times larger
            ratio = float(weight.abs().max() / plain_lora[1][name].abs().max())
            assert ratio == pytest.approx(16, rel=1e-3), name
    assert relative_change(ours[0], plain_lora[0]) > 0.1  # (measured: 1.25)


def test_the_schedule_scales_every_loraplus_group(tiny_model_dir):
    from tuneloop.adapters import add_adapter
    from tuneloop.optim import build_optimizer, build_scheduler

    class Plan:
        warmup_steps, total_steps = 2, 10

    cfg = config_of(tiny_model_dir, loraplus_lr_ratio=8, lr_scheduler="cosine", weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = add_adapter(cfg, fresh_model(tiny_model_dir), "CAUSAL_LM")
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, Plan(), optimizer)
    peaks = [group["initial_lr"] for group in optimizer.param_groups]
    assert sorted(set(peaks)) == [1e-6, LR, LR * 8]
    for _ in range(4):
        optimizer.step()
        scheduler.step()
        multipliers = {group["lr"] / peak for group, peak in zip(optimizer.param_groups, peaks)}
        assert max(multipliers) - min(multipliers) < 1e-12


@pytest.fixture
def gpt2_dir(tmp_path):
    """A tiny GPT-2: its Conv1D layers store their weights (in, out), where nn.Linear stores (out, in)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    return tmp_path / "gpt2"


def test_fan_in_fan_out_says_how_the_layers_store_weights_and_peft_keeps_to_the_layers(gpt2_dir, tiny_model_dir,
                                                                                       plain_lora):
    """peft reads each layer's layout from the layer and overrides a value that contradicts it, so the key never
    changes what is trained (nor in axolotl, which hands it to peft): a contradicting value trains as without the
    key, with a warning, where it used to pass `check` and stop `train` (check cannot see the layers)."""
    from tuneloop.adapters import add_adapter, fan_in_fan_out_note

    ours = tuneloop_step(gpt2_dir, lora_fan_in_fan_out=True, lora_target_modules=["c_attn"])
    assert_same_step(ours, peft_step(gpt2_dir, fan_in_fan_out=True, target_modules=["c_attn"]))
    for value in (False, None):
        assert_same_step(tuneloop_step(gpt2_dir, lora_fan_in_fan_out=value, lora_target_modules=["c_attn"]), ours)
    assert_same_step(tuneloop_step(tiny_model_dir, lora_fan_in_fan_out=True), plain_lora)
    for value, model_dir, targets, note in (
            (True, tiny_model_dir, TARGETS, "`lora_fan_in_fan_out: true` does not match how this model's q_proj, "
                                            "v_proj store their weights (out, in)"),
            (False, gpt2_dir, ["c_attn"], "`lora_fan_in_fan_out: false` does not match how this model's c_attn store "
                                          "their weights (in, out)"),
            (True, gpt2_dir, ["c_attn"], None), (None, tiny_model_dir, TARGETS, None)):
        cfg = config_of(model_dir, lora_fan_in_fan_out=value, lora_target_modules=targets)
        with warnings.catch_warnings():  # (peft's own warning is not said: the note says it in the config's words)
            warnings.filterwarnings("error", message="fan_in_fan_out")
            said = fan_in_fan_out_note(cfg, add_adapter(cfg, fresh_model(model_dir), "CAUSAL_LM"))
        assert said is None if note is None else said.startswith(note), (value, said)


def test_check_and_plan_both_accept_a_fan_in_fan_out_the_layers_contradict(tmp_path, tiny_model_dir, alpaca_file):
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_model_dir, alpaca_file, adapter="lora", lora_target_modules=TARGETS, lora_fan_in_fan_out=True))
    assert run_in_process("check", str(config)).returncode == 0
    planned = run_in_process("plan", str(config), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert any("`lora_fan_in_fan_out: true` does not match" in warning
               for warning in json.loads(planned.stdout)["warnings"])


def test_a_gpt2_adapter_continues_with_lora_model_dir_without_the_key(tmp_path, gpt2_dir):
    """peft saved the adapter with fan_in_fan_out true (its Conv1D layers'); the config without the key asks for the
    same adapter, and used to be refused as differing from it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    get_peft_model(fresh_model(gpt2_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"])).save_pretrained(
        tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    continued = tuneloop_step(gpt2_dir, lora_target_modules=["c_attn"], lora_model_dir=str(tmp_path / "adapter"))
    assert set(continued[1]) == {name for name in continued[1] if "lora_" in name} and continued[1]


def test_dora_run_continues_from_its_adapter_with_lora_model_dir(tmp_path, tiny_model_dir, alpaca_file):
    """Two `tuneloop train` runs: DoRA for 3 steps, then a second run that starts from the first one's folder (at a
    learning rate too small to move it): it saves the first run's B matrices and magnitudes, not a new adapter's."""
    from safetensors.torch import load_file

    keys = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_modules=TARGETS, peft_use_dora=True, max_steps=3,
                learning_rate=1e-2)
    first = write_config(tmp_path / "first.yml", **base_config(tmp_path, tiny_model_dir, alpaca_file, **keys))
    result = run_in_process("train", str(first))
    assert result.returncode == 0, result.stderr[-3000:]
    second_keys = base_config(tmp_path, tiny_model_dir, alpaca_file, **dict(
        keys, max_steps=1, learning_rate=1e-9, lora_model_dir=str(tmp_path / "out"), output_dir=str(tmp_path / "b")))
    plan = run_in_process("plan", str(write_config(tmp_path / "second.yml", **second_keys)), "--json")
    assert plan.returncode == 0, plan.stderr[-3000:]
    result = run_in_process("train", str(tmp_path / "second.yml"))
    assert result.returncode == 0, result.stderr[-3000:]

    before, after = load_file(tmp_path / "out" / "adapter_model.safetensors"), load_file(
        tmp_path / "b" / "adapter_model.safetensors")
    assert before.keys() == after.keys() and any("lora_magnitude_vector" in key for key in after)
    assert all(float(before[key].abs().max()) > 0 for key in before if "lora_B" in key)  # the first run trained B
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=1e-6)
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text())["use_dora"] is True
    # the plan counts DoRA's magnitudes: A (4×64) and B (out×4) and one magnitude per output feature, per layer
    lora = sum(4 * 64 + out * 4 + out for out in (64, 32)) * 2  # q_proj: 64 out, v_proj: 2 kv heads × 16 = 32 out
    assert json.loads(plan.stdout)["memory"]["trainable_parameters"] == lora
    assert read_metrics(tmp_path / "b")


def test_lora_model_dir_must_hold_an_adapter(tmp_path, tiny_model_dir, alpaca_file):
    for folder, what in ((tmp_path / "missing", "is not a folder"), (tmp_path, "holds no adapter_config.json")):
        config = write_config(tmp_path / "run.yml", **base_config(
            tmp_path, tiny_model_dir, alpaca_file, adapter="lora", lora_target_modules=TARGETS, max_steps=1,
            lora_model_dir=str(folder)))
        assert_user_error(run_in_process("train", str(config)), f"`lora_model_dir: {folder}` {what}",
                          "give the folder of a saved LoRA adapter")


def test_lora_model_dir_refuses_settings_its_adapter_was_not_made_with(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    from tuneloop.errors import UserError

    LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=True).save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"lora_r \(4 there, 8 here\); peft_use_dora \(True there, False here\)"):
        tuneloop_step(tiny_model_dir, lora_model_dir=str(tmp_path), lora_r=8)
    pissa = tmp_path / "pissa"
    LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights="pissa").save_pretrained(pissa)
    with pytest.raises(UserError, match="started with init_lora_weights=pissa, which rewrote its base weights"):
        tuneloop_step(tiny_model_dir, lora_model_dir=str(pissa), lora_r=8)
    patterned = tmp_path / "patterned"
    LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, rank_pattern={"q_proj": 2}).save_pretrained(patterned)
    with pytest.raises(UserError, match=r"lora_rank_pattern \(\{'q_proj': 2\} there, \{\} here\)"):
        tuneloop_step(tiny_model_dir, lora_model_dir=str(patterned), lora_r=8)


@pytest.mark.parametrize("keys, message", [
    ({"peft_init_lora_weights": "pissa"}, "rewrites the base model's weights"),
    ({"peft_init_lora_weights": "pissa_niter_4"}, "rewrites the base model's weights"),
    ({"peft_init_lora_weights": "eva"}, "a pass over the data"),
    ({"peft_init_lora_weights": "kaiming"}, "use true, false or one of gaussian, mica, orthogonal"),
    ({"peft": {"loftq_config": {"loftq_bits": 4}}}, "`loftq_config` (LoftQ) asks for a LoRA variant"),
    ({"loraplus_lr_ratio": 0}, "must be above 0"),
    ({"loraplus_lr_embedding": 1e-5}, "set `loraplus_lr_ratio` too"),
    ({"loraplus_lr_ratio": 16, "lr_scheduler": "one_cycle"}, "one_cycle drives every parameter group"),
    ({"peft_init_lora_weights": "orthogonal", "lora_r": 5}, "needs an even `lora_r`"),
    ({"peft_init_lora_weights": "gaussian", "lora_model_dir": "/tmp"}, "remove one of them"),
    ({"adapter": None, "peft_use_dora": True}, "`peft_use_dora` shapes a LoRA adapter, and this run trains none"),
    ({"lora_target_parameters": ["mlp.down_proj.weight"], "lora_fan_in_fan_out": True},
     "`lora_fan_in_fan_out: true` with `lora_target_parameters`"),
])
def test_bad_lora_variant_settings_are_refused_in_one_line(tmp_path, tiny_model_dir, alpaca_file, keys, message):
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_model_dir, alpaca_file, **{"adapter": "lora", "lora_target_modules": TARGETS, **keys}))
    assert_user_error(run_in_process("check", str(config)), message)
