"""A process reward model's rows (`process_reward_model: true`): axolotl's `type: stepwise_supervised`.

A row holds `prompt` (text), `completions` (the reasoning steps, a list of texts) and `labels` (one true/false per
step: is the step correct?). As axolotl writes it (prompt_strategies/stepwise_supervised.py, after TRL's
PRMTrainer): [BOS] prompt, then each step's tokens followed by `step_separator`'s tokens (default "\\n"), each part
tokenized on its own without special tokens; the last token of each step (its separator's last) carries the step's
label, 0 or 1, and every other token IGNORE_INDEX. `train_on_last_step_only` labels the last step alone;
`max_completion_length` cuts the steps' tokens (labels with them), and sequence_len cuts the whole row, as
axolotl's strategy does (a cut step loses its label; a row left with no label is dropped and counted).

The store keeps each row's labels at their tokens. The causal collator moves every label one to the left (its
target at position t is the label at t+1: data/labels.py), so the token classifier's objective
(train/process_reward_model.py) pairs the logits at position t+1 with target t: the label at each step's end is
read back at that very token. The label at position 0 has no target there, so a row whose first token would be
labelled (no BOS, an empty prompt and a one-token first step) is refused.
Like every module of data/, this one sits under the config and does not import it.
"""

from __future__ import annotations

import numpy as np

from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.load import SourceRow
from tuneloop.errors import UserError

STEPWISE_TYPES = ("stepwise_supervised",)  # dataset `type:` values of a process reward model
DEFAULT_STEP_SEPARATOR = "\n"


def _step_labels(row: SourceRow) -> tuple[str, list[str], list[int]]:
    prompt, completions, labels = (row.values.get(name) for name in ("prompt", "completions", "labels"))
    if not isinstance(prompt, str):
        raise UserError(f"data: {row.where}: field `prompt` must be text; got {type(prompt).__name__}")
    if not isinstance(completions, list) or not completions or not all(isinstance(c, str) for c in completions):
        raise UserError(f"data: {row.where}: field `completions` must be a non-empty list of texts (the steps)")
    if not isinstance(labels, list) or not all(isinstance(v, bool) or v in (0, 1) for v in labels):
        raise UserError(f"data: {row.where}: field `labels` must be a list of true/false, one per step")
    if len(labels) != len(completions):
        raise UserError(f"data: {row.where}: {len(completions)} completions (steps) and {len(labels)} labels: give "
                        "one label per step")
    return prompt, completions, [int(v) for v in labels]


def stepwise_tokens(row: SourceRow, entry, tokenizer, sequence_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, labels) of one row: each step's label on its last token (its separator's), IGNORE_INDEX
    elsewhere; axolotl's StepwiseSupervisedPromptTokenizingStrategy.tokenize_prompt, token for token."""
    prompt, completions, labels = _step_labels(row)
    if entry.train_on_last_step_only:
        labels = [IGNORE_INDEX] * (len(labels) - 1) + [labels[-1]]
    separator = entry.step_separator if entry.step_separator is not None else DEFAULT_STEP_SEPARATOR
    separator_ids = tokenizer.encode(separator, add_special_tokens=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    step_labels: list[int] = []
    for text, label in zip(completions, labels):
        step = tokenizer(text, add_special_tokens=False)["input_ids"] + separator_ids
        if not step:
            raise UserError(f"data: {row.where}: a step and its separator ({separator!r}) make no tokens, so the "
                            "step's label has no token to sit on")
        ids += step
        step_labels += [IGNORE_INDEX] * (len(step) - 1) + [label]
    if entry.max_completion_length:
        ids, step_labels = ids[:entry.max_completion_length], step_labels[:entry.max_completion_length]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    all_ids = (prompt_ids + ids)[:sequence_len]
    all_labels = ([IGNORE_INDEX] * len(prompt_ids) + step_labels)[:sequence_len]
    if all_labels and all_labels[0] != IGNORE_INDEX:
        raise UserError(f"data: {row.where}: the first token would carry a step's label (an empty prompt, no BOS "
                        "token, a one-token first step), and a label is read at the token after a position: give "
                        "the row a prompt")
    return np.asarray(all_ids, dtype=np.int64), np.asarray(all_labels, dtype=np.int64)
