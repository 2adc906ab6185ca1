"""EBFT's feature-matching reward (`rl: ebft`, structured mode; Jelassi et al. 2026, "Matching Features, Not Tokens").

Each row is a prompt and its reference answer (`ground_truth`). A completion's features are the hidden states of the
starting model (frozen: a LoRA run's base with the adapter switched off, else the frozen copy the run keeps) at the
`ebft.feature_layers` depths (fraction f of L layers: the output of layer int(f·L), hidden_states[int(f·L)] as
transformers counts them, the embeddings being 0), concatenated and pooled over the sequence prompt + completion
(`embed_method`: the last token, the mean of every token, the mean of the completion's tokens, or the tokens at a
quarter, half and three quarters of the length, concatenated). The reference answer's are pooled the same way over
prompt + answer. Per group of a prompt's n completions, with φ the pooled features L2-normalised (or whitened by the
group's SVD, `use_whitening`), the paper's equation 7:

    r_j = alignment_coef · 2·cos(φ(ŷ_j), φ(y))  −  diversity_coef · 2/(n−1) · Σ_{j'≠j} φ(ŷ_j)·φ(ŷ_j')

which GRPO's advantages then normalise in the group like any reward. The step line logs the two terms' means and the
conditional feature-matching loss ‖mean_j φ(ŷ_j) − φ(y)‖² (the paper's equation 2), averaged over the prompts.

What differs from axolotl's trainer, each on purpose:
- A group's completions are compared as a whole group over every rank: each rank pools its own completions' features,
  the step gathers them (with the rewards), and the rewards are computed over the whole step, so N ranks == one
  process (axolotl reshapes each rank's slice into groups, which mixes prompts when a group spans ranks).
- The sequences are the token ids themselves (prompt tokens + completion tokens without the stop token; prompt tokens
  + the answer tokenized alone), not texts decoded and tokenized again; the rewards are computed in float32.
- `completion_mean` pools the completion's tokens (axolotl's structured trainer fails on it: no prompt lengths).
- `adaptive_max_tokens` caps a step's completions at its longest reference answer × `gt_length_multiplier` (at least
  64 tokens, as axolotl), over the step's prompts on every rank (axolotl: per rank), and never above
  trl.max_completion_length (axolotl's floor of 64 could exceed it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tuneloop.errors import UserError
from tuneloop.log_probs import reference_mode

REWARD_NAME = "ebft"  # the reward's name on the train line (`rewards/ebft`) and in completions.jsonl
ANSWER_COLUMN = "ground_truth"
ADAPTIVE_FLOOR = 64  # the fewest tokens an adaptive cap allows (axolotl's)
WHITENING_TOLERANCE = 1e-5  # singular values below this share of the largest are left out (a pseudo-inverse)


def ebft_settings(cfg):
    """The run's `ebft:` block, axolotl's defaults where it is absent."""
    from tuneloop.config.ebft_block import EBFTBlock

    return cfg.ebft if cfg.ebft is not None else EBFTBlock()


def feature_layers(model_config, fractions: list[float]) -> list[int]:
    """hidden_states indices of the depths (0: the embeddings, L: the last layer's output)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = text.num_hidden_layers
    return [int(fraction * layers) for fraction in fractions]


def pooled(hidden: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor, method: str) -> torch.Tensor:
    """[B, S, D] features of right-padded rows → [B, D] (or [B, 3D] for concat): see the module's text."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if method == "last_token":
        return hidden[rows, lengths - 1]
    if method == "concat":
        quarters = [(lengths * k // 4).clamp(max=hidden.shape[1] - 1) for k in (1, 2, 3)]
        return torch.cat([hidden[rows, where] for where in quarters], dim=-1)
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = positions < lengths.unsqueeze(1)
    if method == "completion_mean":
        mask &= positions >= prompt_lengths.unsqueeze(1)
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def whitened(group: torch.Tensor, answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's [n, D] features and its answer's [1, D], both times W = U·diag(1/s)·Uᵀ from the SVD of the group's
    features (groupᵀ = U·diag(s)·Vᵀ; singular values below WHITENING_TOLERANCE of the largest left out), applied
    as (x·U)·diag(1/s)·Uᵀ: W itself is D × D."""
    u, s, _ = torch.linalg.svd(group.T, full_matrices=False)
    inverse = torch.where(s > WHITENING_TOLERANCE * s.max(), 1.0 / (s + 1e-12), torch.zeros_like(s))
    return ((group @ u) * inverse) @ u.T, ((answer @ u) * inverse) @ u.T


@dataclass
class StepFeatureRewards:
    rewards: torch.Tensor  # [completions] float64
    line: dict  # the step line's ebft/* numbers


def feature_rewards(completions: torch.Tensor, answers: torch.Tensor, group: int, settings) -> StepFeatureRewards:
    """Equation 7 over the step's [N, D] completion features, group after group (N = groups × group), each group's
    reference answer a row of `answers` [groups, D]. float32 in, float64 rewards out."""
    completions, answers = completions.float(), answers.float()
    grouped = completions.view(-1, group, completions.shape[-1])
    if settings.use_whitening:
        pairs = [whitened(one, answer.unsqueeze(0)) for one, answer in zip(grouped, answers)]
        grouped = torch.stack([pair[0] for pair in pairs])
        answers = torch.cat([pair[1] for pair in pairs])
    else:
        grouped, answers = F.normalize(grouped, dim=-1), F.normalize(answers, dim=-1)
    alignment = 2 * F.cosine_similarity(grouped, answers.unsqueeze(1).expand_as(grouped), dim=-1)
    similarity = grouped @ grouped.transpose(1, 2)
    others = similarity.sum(dim=-1) - similarity.diagonal(dim1=1, dim2=2)
    diversity = 2 * others / (group - 1)
    rewards = settings.alignment_coef * alignment - settings.diversity_coef * diversity
    matching = ((grouped.mean(dim=1) - answers) ** 2).sum(dim=-1).mean()
    line = {"ebft/alignment": float(alignment.mean()), "ebft/diversity": float(diversity.mean()),
            "ebft/cfm_loss": float(matching)}
    return StepFeatureRewards(rewards.reshape(-1).double(), line)


def completion_cap(cfg, prompts, step_prompts: list[int]) -> int:
    """The most tokens a completion of this step may have: trl.max_completion_length, or under `rl: ebft` with
    `adaptive_max_tokens` the step's longest reference answer × gt_length_multiplier, within [64, that]. The plan
    computes it for every generation (rows.py), the rollout for its own."""
    from tuneloop.rl_methods import matches_features

    longest = cfg.trl_settings.max_completion_length
    settings = ebft_settings(cfg)
    if not matches_features(cfg) or not settings.adaptive_max_tokens:
        return longest
    wanted = max(min(int(prompts.reply_lengths[p] * settings.gt_length_multiplier), longest) for p in step_prompts)
    return min(max(wanted, ADAPTIVE_FLOOR), longest)


def features_model(policy, reference):
    """(the model whose features are compared, the context it computes them in): the frozen copy of the starting
    model, or the LoRA policy with its adapter switched off."""
    if reference is not None:
        return reference, None
    return policy, reference_mode


class FeatureMatching:
    """The rollout's side of the reward (rollout.py): each rank's pooled features, then the step's rewards."""

    def __init__(self, cfg, prompts, tokenizer, micro_batch_size: int, model_config):
        self.cfg, self.prompts, self.tokenizer = cfg, prompts, tokenizer
        self.settings = ebft_settings(cfg)
        self.group = cfg.trl_settings.num_generations
        self.micro_batch_size = micro_batch_size
        self.layers = feature_layers(model_config, self.settings.feature_layers)
        self.answer_tokens: dict[int, list[int]] = {}
        self.answer_features: dict[int, torch.Tensor] = {}  # (the feature model is frozen: once per prompt)

    def answer(self, prompt: int) -> list[int]:
        if prompt not in self.answer_tokens:
            text = self.prompts.columns[prompt].get(ANSWER_COLUMN)
            if not isinstance(text, str):
                raise UserError(f"data: {self.prompts.where[prompt]}: `rl: ebft` compares each completion with the "
                                f"row's reference answer, its `{ANSWER_COLUMN}` column, and this row's is "
                                f"{type(text).__name__}: give every row a `{ANSWER_COLUMN}` text (or a `type:` "
                                "transform that makes one, e.g. ebft_opencode.transform)")
            self.answer_tokens[prompt] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.answer_tokens[prompt]

    @torch.no_grad()
    def features(self, model, context, sequences: list[list[int]], prompt_lengths: list[int], device,
                 autocast) -> torch.Tensor:
        """[len(sequences), D] pooled features (float32, on the host), micro_batch_size rows a forward."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        body = base.get_decoder() if hasattr(base, "get_decoder") else None
        pad = self.tokenizer.pad_token_id
        was_training = model.training
        model.eval()
        parts = []
        try:
            with context(model) if context is not None else contextlib.nullcontext():
                for start in range(0, len(sequences), self.micro_batch_size):
                    chunk = sequences[start:start + self.micro_batch_size]
                    lengths = torch.tensor([len(ids) for ids in chunk], dtype=torch.long)
                    input_ids = torch.full((len(chunk), int(lengths.max())), pad, dtype=torch.long)
                    for row, ids in enumerate(chunk):
                        input_ids[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
                    attention = (torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
                    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention.to(device)}
                    with autocast():
                        if body is not None:  # (no output head: its logits are not wanted)
                            hidden = body(**inputs, output_hidden_states=True).hidden_states
                        else:
                            hidden = model(**inputs, output_hidden_states=True, logits_to_keep=1).hidden_states
                    stacked = torch.cat([hidden[index] for index in self.layers], dim=-1).float()
                    starts = torch.tensor(prompt_lengths[start:start + len(chunk)], dtype=torch.long)
                    parts.append(pooled(stacked, lengths.to(stacked.device), starts.to(stacked.device),
                                        self.settings.embed_method).cpu())
        finally:
            model.train(was_training)
        return torch.cat(parts)

    def local_features(self, policy, reference, completions, owned: list[int], stops: set[int], device,
                       autocast) -> tuple[torch.Tensor, dict]:
        """This rank's completions' features [L, D], and its prompts' answers' {prompt: [D]} (computed once each)."""
        model, context = features_model(policy, reference)
        sequences = []
        for prompt, tokens in zip(completions.prompt_ids, completions.tokens):
            tokens = list(tokens[:-1]) if tokens and tokens[-1] in stops else list(tokens)
            sequences.append(list(prompt) + tokens)
        prompt_lengths = [len(prompt) for prompt in completions.prompt_ids]
        generated = self.features(model, context, sequences, prompt_lengths, device, autocast)
        missing = [p for p in dict.fromkeys(owned) if p not in self.answer_features]
        if missing:
            limit = self.cfg.sequence_len
            answers = [(list(self.prompts.ids[p]) + self.answer(p))[:limit] for p in missing]
            found = self.features(model, context, answers, [len(self.prompts.ids[p]) for p in missing], device,
                                  autocast)
            self.answer_features.update(zip(missing, found))
        return generated, {p: self.answer_features[p] for p in dict.fromkeys(owned)}

    def step_rewards(self, generated: torch.Tensor, answers: dict, owned: list[int]) -> StepFeatureRewards:
        """The step's rewards from every rank's features (in completion order; `owned`: each one's prompt)."""
        per_group = torch.stack([answers[owned[first]] for first in range(0, len(owned), self.group)])
        return feature_rewards(generated, per_group, self.group, self.settings)


def plan_numbers(cfg, model_config) -> dict:
    """What the plan says of the reward: the layers read, the pooling, the comparison and the cap."""
    settings = ebft_settings(cfg)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return {"feature_layers": feature_layers(model_config, settings.feature_layers),
            "num_hidden_layers": text.num_hidden_layers, "embed_method": settings.embed_method,
            "whitening": settings.use_whitening, "alignment_coef": settings.alignment_coef,
            "diversity_coef": settings.diversity_coef,
            "features_from": "the base model, the adapter switched off" if cfg.adapter else
            "a frozen copy of the starting model",
            "adaptive_max_tokens": (settings.gt_length_multiplier if settings.adaptive_max_tokens else None)}
