"""The generation interface: what an engine is given and what it returns (see the package's text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Generated:
    """Completions of a list of prompts, one per prompt, in order."""

    tokens: list  # each completion's tokens, its stop token included where it stopped
    log_probs: list | None  # the sampler's log-prob of each token (None: the engine does not give them)
    seconds: float = 0.0  # wall time of the generation


class Engine(Protocol):
    """An engine that samples completions."""

    name: str  # "transformers" or "vllm"
    gives_log_probs: bool  # whether Generated.log_probs is filled

    def sync(self, policy, step: int) -> None:
        """Make the engine sample from `policy`'s weights as they are after optimizer step `step` (called on every
        rank before each generation; the engine decides who sends what)."""

    def generate(self, policy, prompt_ids: list, seed: int, stops: list, autocast, max_tokens: int) -> Generated:
        """One completion of each prompt, sampled with the run's settings, of at most `max_tokens` tokens (the run's
        max_completion_length, or EBFT's adaptive cap below it); `seed` fixes the random draws."""
