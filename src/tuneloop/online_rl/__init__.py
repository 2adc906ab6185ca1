"""Online RL (`rl: grpo`, `rl: gdpo`): the policy writes its own training data, step by step.

Each optimizer step takes a fixed set of prompts (prompts.py, sampled by rows.py exactly as the plan counts
them), generates `num_generations` completions of each from the weights as they are (rollout.py), scores them
with the user's reward functions (rewards.py), turns the scores into advantages within each prompt's group, and
trains on those completions with GRPO's clipped objective (loss.py) in the same loop as SFT and DPO. The
`trl:` block is read as axolotl and TRL write it (settings.py).
"""
