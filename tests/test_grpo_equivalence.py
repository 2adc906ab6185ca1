"""GRPO's loss and gradients equal TRL 1.16's GRPOTrainer on the same prompts and completions (fed, not generated),
for every loss type, within 1e-5 relative, in fp32. TRL is in the test extra; tuneloop never imports it.

The completions are fixed token ids of different lengths (some end in eos, one is truncated), with advantages,
old log-probs (as after an earlier iteration) and reference log-probs given to both, so the ratio is clipped on
some tokens and the KL term is on."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

COMPLETION_WIDTH = 6
GROUP = 4


@pytest.fixture(scope="module")
def fed(tiny_model_dir):
    """Two prompts, four completions each (TRL's layout: left-padded prompts, right-padded completions)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(3)
    prompts = [tokenizer("the cat sat")["input_ids"], tokenizer("a dog ran far away")["input_ids"]]
    eos = tokenizer.eos_token_id
    lengths = [6, 3, 5, 1, 4, 6, 2, 5]  # the first and sixth run to the limit without eos: truncated
    completions = []
    for index, length in enumerate(lengths):
        tokens = torch.randint(10, 300, (length,), generator=generator).tolist()
        if length < COMPLETION_WIDTH:
            tokens[-1] = eos
        completions.append(tokens)
    advantages = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.9, 0.05, 0.05])
    return tokenizer, prompts, completions, advantages


def trl_inputs(tokenizer, prompts, completions, advantages):
    pad = tokenizer.pad_token_id
    rows = [prompts[index // GROUP] for index in range(len(completions))]
    width = max(len(p) for p in rows)
    prompt_ids = torch.full((len(rows), width), pad)
    prompt_mask = torch.zeros((len(rows), width), dtype=torch.long)
    completion_ids = torch.full((len(rows), COMPLETION_WIDTH), pad)
    completion_mask = torch.zeros((len(rows), COMPLETION_WIDTH), dtype=torch.long)
    for row, (prompt, tokens) in enumerate(zip(rows, completions)):
        prompt_ids[row, width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[row, width - len(prompt):] = 1
        completion_ids[row, :len(tokens)] = torch.tensor(tokens)
        completion_mask[row, :len(tokens)] = 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages.clone()}


def trl_trainer(model, tokenizer, tmp_path, loss_type: str, level: str, beta: float):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=GROUP,
                      gradient_accumulation_steps=1, max_completion_length=COMPLETION_WIDTH, beta=beta,
                      loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=0.28,
                      temperature=0.7, report_to="none", use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * 8), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def tuneloop_batch(tokenizer, prompts, completions, advantages, old, reference, mask):
    from tuneloop.online_rl.rollout import Completions, completion_rows

    owned = [prompts[index // GROUP] for index in range(len(completions))]
    made = Completions(owned, completions, [len(c) for c in completions],
                       [len(c) == COMPLETION_WIDTH for c in completions])
    inputs, targets, extra = completion_rows(made, 0, len(completions), tokenizer.pad_token_id)
    selected = mask.bool()  # TRL's (B, T) values at the completion tokens, row by row: the order of our targets
    extra.update(advantages=advantages, old_log_probs=old[selected], reference_log_probs=reference[selected],
                 rewards=torch.zeros(len(completions), 1), total_reward=torch.zeros(len(completions)),
                 zero_std=torch.zeros(len(completions), dtype=torch.bool),
                 truncated=torch.tensor(made.truncated))
    return inputs, targets, extra


@pytest.mark.parametrize("loss_type,level", [
    ("grpo", "token"), ("bnpo", "token"), ("dr_grpo", "token"), ("dapo", "token"), ("cispo", "token"),
    ("sapo", "token"), ("vespo", "token"), ("luspo", "sequence"), ("grpo", "sequence")])
def test_loss_and_gradients_equal_trl(fed, tiny_model_dir, tmp_path, loss_type, level):
    from transformers import AutoModelForCausalLM

    from tuneloop.online_rl.loss import GRPOLoss
    from tuneloop.online_rl.settings import LOSS_TYPES, TRLBlock

    tokenizer, prompts, completions, advantages = fed
    beta = 0.1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = trl_trainer(model, tokenizer, tmp_path, loss_type, level, beta)
    model = trainer.model
    model.train()
    inputs = trl_inputs(tokenizer, prompts, completions, advantages)
    mask = inputs["completion_mask"]
    with torch.no_grad():  # the policy's own log-probs, moved: an earlier iteration's, and the reference's
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], mask], dim=1)
        current = trainer._get_per_token_logps_and_entropies(model, ids, attention, COMPLETION_WIDTH)[0]
    noise = torch.Generator().manual_seed(5)
    old = (current + 0.3 * torch.randn(current.shape, generator=noise)) * mask
    reference = (current + 0.5 * torch.randn(current.shape, generator=noise)) * mask
    trl_loss = trainer._compute_loss(model, {**inputs, "old_per_token_logps": old, "ref_per_token_logps": reference,
                                             "num_items_in_batch": mask.sum()})
    trl_loss.backward()
    trl_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    settings = TRLBlock(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon=0.2,
                        epsilon_high=0.28, temperature=0.7, max_completion_length=COMPLETION_WIDTH,
                        num_generations=GROUP)
    ours_inputs, targets, extra = tuneloop_batch(tokenizer, prompts, completions, advantages, old, reference, mask)
    loss_sum, stats = GRPOLoss(settings, ["zero"])(model, ours_inputs, targets, extra)
    units = {"completion_tokens": int(mask.sum()), "completions": len(completions), "micro_batches": 1}
    ours = loss_sum / units[LOSS_TYPES[loss_type].unit]
    ours.backward()
    assert float(ours) == pytest.approx(float(trl_loss), rel=1e-5, abs=1e-7)
    for mine, theirs in zip((p.grad for p in model.parameters()), trl_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    assert stats.shape[0] == GRPOLoss(settings, ["zero"]).stat_width
