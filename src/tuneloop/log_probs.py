"""The log-probability of target tokens under a model: what preference losses and online RL train on.

Only target positions meet the output projection, a chunk at a time under checkpointing (a chunk's logits are made
again in the backward instead of kept): the [tokens, vocabulary] logits are never whole. `reference_mode` turns a
LoRA model into its base (the adapter switched off) for a reference model's log-probs without a second copy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.kernels.output_head import chunk_tokens, output_head


def _target_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def token_log_probs(model, inputs: dict, targets: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each target token, the flat positions they sit at). Where the logits are decoder
    states @ weight, only target positions meet the projection, a chunk at a time under checkpointing (a
    chunk's logits are made again in the backward instead of kept). `temperature`: of the distribution the
    tokens were sampled from (online RL scores its completions under it, as TRL does)."""
    flat_targets = targets.reshape(-1)
    positions = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    wanted = flat_targets[positions]
    head = output_head(model)
    if head is None:
        logits = model(**inputs).logits
        log_probs = torch.log_softmax(logits.reshape(-1, logits.shape[-1])[positions].float() / temperature, dim=-1)
        return log_probs.gather(1, wanted.unsqueeze(1)).squeeze(1), positions
    decoder, weight = head
    hidden = decoder(**inputs).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[positions]
    rows = chunk_tokens(weight.shape[0])
    parts = []
    for start in range(0, hidden.shape[0], rows):
        chunk, chunk_targets = hidden[start:start + rows], wanted[start:start + rows]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_target_log_probs, chunk, weight, chunk_targets, temperature,
                                    use_reentrant=False))
        else:
            parts.append(_target_log_probs(chunk, weight, chunk_targets, temperature))
    return (torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)), positions


def sequence_log_probs(model, inputs: dict, targets: torch.Tensor, sequence_index: torch.Tensor,
                       n_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's targets, its number of targets), both [n_sequences]."""
    values, positions = token_log_probs(model, inputs, targets)
    owner = sequence_index.reshape(-1)[positions]
    sums = torch.zeros(n_sequences, dtype=torch.float32, device=values.device).index_add(0, owner, values)
    counts = torch.bincount(owner, minlength=n_sequences).to(torch.float32)
    return sums, counts


@contextlib.contextmanager
def reference_mode(model):
    """The LoRA model as its base (the adapter switched off), or nothing to change."""
    with model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext():
        yield
