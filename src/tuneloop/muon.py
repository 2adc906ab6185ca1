"""Muon as axolotl defines it (`optimizer: muon`, axolotl-contribs-mit 0.0.6, the version axolotl pins). The hidden
weight matrices take SGD momentum whose update is orthogonalised by a Newton-Schulz iteration; the rest (embeddings, the
output head, peft's modules_to_save, and 1-D weights) take an AdamW of its own.

What a step does, per hidden matrix W (A × B) with gradient G and momentum buffer M:
    M ← μ·M + G;  U ← G + μ·M (Nesterov) or M;  O ← NewtonSchulz5(U) in bf16
    W ← W·(1 − lr·wd) − lr · 0.2·√max(A, B) · O          (the 0.2·√max(A, B) matches AdamW's update RMS)
and per other weight w, the AdamW written as axolotl's Muon writes it (ε added to √v before the bias correction,
the decay on the weight itself):
    m ← lerp(m, g, 1 − β1);  v ← lerp(v, g², 1 − β2);  w ← w·(1 − lr·wd) − lr·√(1 − β2ᵗ)/(1 − β1ᵗ) · m/(ε + √v)

Where tuneloop differs from axolotl's code, and why: axolotl's factory leaves 1-D weights (norms, biases) out of
the optimizer altogether, so a full fine-tune never moves them although the Muon class says they take AdamW;
tuneloop steps them with the AdamW, as the class documents, without weight decay (as every other tuneloop
optimizer). A weight of 3+ dimensions (transformers 5 holds an MoE layer's experts as one [experts, rows, cols]
weight) is a stack of matrices, each orthogonalised and scaled on its own, as Microsoft's Dion Muon (axolotl's
newer one) treats it; axolotl 0.0.6's asserts 2-D weights and stops. The orthogonalisation needs whole matrices: a sharding engine would hand it shards, so Muon runs
under the DDP engine only (config/rules.py refuses the rest).
"""

from __future__ import annotations

import math

import torch

NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, tuned for slope at zero
NEWTON_SCHULZ_STEPS = 5
MOMENTUM = 0.95
DEFAULT_ADAMW_BETAS = (0.95, 0.95)  # axolotl's Muon, unless adam_beta1 and adam_beta2 are both set
HEAD_AND_EMBEDDING_NAMES = ("embed_tokens", "lm_head")


def is_hidden_matrix(name: str, parameter: torch.Tensor) -> bool:
    """What Muon orthogonalises: a weight of 2+ dimensions that is not the embeddings, the output head or one of
    peft's modules_to_save (matched by name, as axolotl does)."""
    if parameter.ndim < 2 or name.endswith("modules_to_save.default.weight"):
        return False
    return not any(part in name for part in HEAD_AND_EMBEDDING_NAMES)


def newton_schulz(update: torch.Tensor) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `update`, roughly (singular values land in ~[0.5, 1.5]), in bf16; a
    stack of matrices (MoE experts held as one [experts, rows, cols] weight) is orthogonalised matrix by matrix."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm at most 1
    for _ in range(NEWTON_SCHULZ_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def rms_matched_rate(learning_rate: float, shape: torch.Size) -> float:
    """A matrix's learning rate: lr × 0.2·√max(A, B) of its last two dimensions (one expert's, in a stack), so an
    orthogonal update moves it as much as AdamW would."""
    rows, columns = shape[-2:]
    return learning_rate * 0.2 * math.sqrt(max(rows, columns))


class Muon(torch.optim.Optimizer):
    """Groups carry `muon: True` (hidden matrices) or False (the AdamW ones); the scheduler scales every group's
    `lr` as it does any optimizer's."""

    def __init__(self, groups: list[dict], lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                 momentum: float = MOMENTUM, nesterov: bool = True):
        super().__init__(groups, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum,
                                      nesterov=nesterov, muon=False))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if group["muon"]:
                    self._muon_step(parameter, group)
                else:
                    self._adamw_step(parameter, group)
        return loss

    def _muon_step(self, parameter: torch.Tensor, group: dict) -> None:
        gradient = parameter.grad
        state = self.state[parameter]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(gradient)
        buffer = state["momentum_buffer"]
        buffer.mul_(group["momentum"]).add_(gradient)
        update = gradient.add(buffer, alpha=group["momentum"]) if group["nesterov"] else buffer
        orthogonal = newton_schulz(update).to(parameter.dtype)
        parameter.mul_(1 - group["lr"] * group["weight_decay"])
        parameter.add_(orthogonal, alpha=-rms_matched_rate(group["lr"], parameter.shape))

    def _adamw_step(self, parameter: torch.Tensor, group: dict) -> None:
        gradient = parameter.grad
        state = self.state[parameter]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # a tensor, as torch's optimizers keep it
            state["exp_avg"] = torch.zeros_like(gradient)
            state["exp_avg_sq"] = torch.zeros_like(gradient)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(gradient, 1 - beta1)
        state["exp_avg_sq"].lerp_(gradient.square(), 1 - beta2)
        direction = state["exp_avg"] / (group["eps"] + state["exp_avg_sq"].sqrt())
        scale = math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        parameter.mul_(1 - group["lr"] * group["weight_decay"])
        parameter.add_(direction, alpha=-group["lr"] * scale)


def muon_groups(named_parameters, weight_decay: float, no_decay_names: tuple[str, ...]) -> list[dict]:
    """Four groups, always (a checkpoint's optimizer state fits every start): the hidden matrices with and without
    weight decay, the AdamW weights with and without (as tuneloop decays: matrices, not biases or norms)."""
    groups = {(muon, decays): [] for muon in (True, False) for decays in (True, False)}
    for name, parameter in named_parameters:
        if not parameter.requires_grad:
            continue
        decays = parameter.ndim >= 2 and not any(part in name.lower() for part in no_decay_names)
        groups[(is_hidden_matrix(name, parameter), decays)].append(parameter)
    return [{"params": params, "muon": muon, "weight_decay": weight_decay if decays else 0.0}
            for (muon, decays), params in groups.items()]


def adamw_betas(cfg) -> tuple[float, float]:
    """axolotl passes the betas to its Muon only when both are in the config; otherwise Muon's own (0.95, 0.95)."""
    given = cfg.adam_beta1 is not None and cfg.adam_beta2 is not None
    return (cfg.adam_beta1, cfg.adam_beta2) if given else DEFAULT_ADAMW_BETAS


def build_muon(named_parameters, cfg, no_decay_names: tuple[str, ...]) -> Muon:
    return Muon(muon_groups(named_parameters, cfg.weight_decay, no_decay_names), lr=cfg.learning_rate,
                weight_decay=cfg.weight_decay, betas=adamw_betas(cfg), eps=cfg.adam_epsilon)


def muon_words(cfg) -> str:
    """What the plan says of the optimizer."""
    betas = adamw_betas(cfg)
    return (f"(hidden matrices: momentum {MOMENTUM}, Nesterov, {NEWTON_SCHULZ_STEPS} Newton-Schulz steps, "
            f"lr × 0.2·√max(rows, cols); embeddings, head and 1-D weights: AdamW, betas ({betas[0]:g}, {betas[1]:g}))")
