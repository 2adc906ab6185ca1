"""Completions sampled by transformers' `generate` on the training weights themselves: nothing to sync."""

from __future__ import annotations

import time

import torch

from tuneloop.generation.interface import Generated


class TransformersEngine:
    """Batched, left-padded, KV-cached `generate` on the policy (a LoRA adapter as it is, no merged copy), in eval
    mode, under a random stream seeded by `seed` (the training's random state is restored after). `autocast`: the
    training forward's mixed precision, so the policy samples as it computes when it trains (on a CPU, decoding reads
    every weight once a token: bf16 autocast generated the embedded model's completions 1.45× faster than fp32)."""

    name = "transformers"
    gives_log_probs = False

    def __init__(self, settings, tokenizer, device):
        self.settings, self.tokenizer, self.device = settings, tokenizer, device

    def sync(self, policy, step: int) -> None:
        return None  # generate reads the training weights

    @torch.no_grad()
    def generate(self, policy, prompt_ids: list, seed: int, stops: list, autocast, max_tokens: int) -> Generated:
        from transformers import GenerationConfig

        start = time.perf_counter()
        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention[row, width - len(ids):] = 1
        sampling = self.settings.generation_settings()
        sampling.pop("stop_token_ids", None)  # (in `stops` already)
        config = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=stops,
                                  pad_token_id=pad, use_cache=True, **sampling)
        was_training = policy.training
        policy.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), autocast():
                torch.manual_seed(seed)
                output = policy.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                         generation_config=config)
        finally:
            policy.train(was_training)
        return Generated(output[:, width:].cpu().tolist(), None, time.perf_counter() - start)
