"""`tuneloop eval CONFIG`: the config's eval set through a model, measured exactly as the run measures it.

The same prepared rows, the same eval micro-batches and collator as the training loop builds, the same
objective and precision, and the model in the config's weights dtype and attention: so on the run's own
output_dir it reproduces the run's last eval, and `--model BASE` says what training changed.
"""

from __future__ import annotations

from pathlib import Path

from tuneloop.errors import UserError
from tuneloop.use.folders import ModelFolder, find_model_folder, load_model_from


def check_has_eval_set(cfg) -> None:
    if cfg.rl in ("grpo", "gdpo"):
        raise UserError(f"eval: `rl: {cfg.rl}` measures a model by its rewards (the train lines in metrics.jsonl); "
                        "to measure the loss on held-out text, run `tuneloop eval` with a supervised config of that "
                        "data and `--model` this run's output")
    if not cfg.val_set_size and not cfg.test_datasets:
        raise UserError("eval: the config has no eval set; set `val_set_size` (a fraction of the data held out, "
                        "e.g. 0.05) or `test_datasets` (files of their own)")


def eval_folder(cfg, model: str | None) -> ModelFolder:
    """`--model DIR`, else the run's output_dir (an adapter there sits on the config's base_model)."""
    if model is not None:
        return find_model_folder(model, "eval: --model")
    output_dir = Path(cfg.output_dir)
    found = find_model_folder(output_dir, "eval: output_dir", no_model_hint=(
        "; train first (`tuneloop train CONFIG`), or name a model with --model DIR"))
    return ModelFolder(found.path, cfg.base_model) if found.is_adapter else found


def evaluate_model(cfg, model: str | None = None) -> dict:
    """{"model", "eval_loss", "eval_perplexity", "eval_token_accuracy", "eval_tokens"} of the config's eval set (a
    preference config's: eval_loss, the rewards and the reward accuracy, against its reference)."""
    check_has_eval_set(cfg)
    folder = eval_folder(cfg, model)

    import numpy as np
    import torch
    from accelerate import Accelerator

    from tuneloop.data.batching import epoch_micro_batches
    from tuneloop.data.collate import collator_for
    from tuneloop.data.images import image_inputs_of
    from tuneloop.engines.base import forget_accelerate_state
    from tuneloop.model.kinds import SEQUENCE_CLASSIFICATION
    from tuneloop.plan.build import data_plan
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data
    from tuneloop.train.evaluate import evaluate
    from tuneloop.train.objectives import ObjectiveModule, objective_of

    resolved = resolve_run(cfg)
    tokenizer, rows = prepare_data(cfg, resolved)
    prepared = rows.prepared
    if prepared.eval is None or len(prepared.eval) == 0:
        raise UserError("eval: the eval set is empty after preparing the data (every held-out row was dropped or "
                        "the split gave none); raise `val_set_size` or check `test_datasets`")
    plan = data_plan(cfg, resolved, rows, world_size=1)  # (the eval batches and their widths, as the run had them)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=resolved.precision.mixed)
    try:
        loaded = load_for_eval(cfg, resolved, folder, len(tokenizer)).to(accelerator.device)
        if resolved.model_kind == SEQUENCE_CLASSIFICATION:  # an adapter's base config may lack the run's pad id,
            loaded.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # which finds the scored token
        spec = plan.eval_batching  # as TrainingLoop builds them: the run's own eval batches
        batches = epoch_micro_batches(np.asarray(prepared.eval.unit_column("length")), spec, 0, shuffle=False,
                                      even=False)[0]
        collate = collator_for(prepared.eval, tokenizer.pad_token_id, spec.mode == "packed", plan.padding.unfixed(),
                               decoder_start_token_id=getattr(loaded.config, "decoder_start_token_id", None),
                               images=image_inputs_of(tokenizer))  # a vision-language run's pixels, as the loop's
        reference = reference_for_eval(cfg, resolved, folder, len(tokenizer), accelerator.device)
        runner = ObjectiveModule(loaded, objective_of(cfg, reference))
        result = evaluate(runner, batches, collate, runner.objective, accelerator)
    finally:
        forget_accelerate_state()  # the next command in this process may ask for another precision
    return {"model": str(folder.path), **result}


def reference_for_eval(cfg, resolved, folder: ModelFolder, vocabulary: int, device):
    """A DPO/IPO config's reference: the config's base_model, frozen (an adapter's is its base with the adapter
    switched off: None here). The rewards and the loss are then those the run logged."""
    from tuneloop.rl_methods import RL_METHODS

    if not cfg.rl or not RL_METHODS[cfg.rl].uses_reference or folder.is_adapter:
        return None
    base = load_for_eval(cfg, resolved, find_model_folder(cfg.base_model, "eval: base_model"), vocabulary)
    base.requires_grad_(False)
    return base.eval().to(device)


def load_for_eval(cfg, resolved, folder: ModelFolder, vocabulary: int):
    """In the config's weights dtype and attention, as the run loaded it; the cache off, as in training (packed
    rows need it off). A QLoRA / 8-bit run's adapter sits on its base quantized as the run quantized it, so the
    eval is the run's own."""
    from tuneloop.adapters import prepare_quantized
    from tuneloop.model.load import grow_embeddings, quantized_base, weights_dtype
    from tuneloop.model.model_config import model_class, model_config

    # the run's base gets the run's config (overrides_of_model_config applied), as load_model gives it
    runs_base = folder.is_adapter and folder.base == cfg.base_model
    base_config = model_config(cfg) if runs_base else None
    quantized = quantized_base(cfg) if runs_base else None
    model = load_model_from(folder, weights_dtype(cfg), attn_implementation=resolved.attention.used,
                            model_class=model_class(cfg, resolved.model_kind) if cfg.model_type else None,
                            base_config=base_config, trust_remote_code=cfg.trust_remote_code, vocabulary=vocabulary,
                            quantization=quantized.bnb_config if quantized else None)
    if quantized:
        quantized.quantize_experts(model)
        # the norms in fp32 and the 4-bit layout, as the run's model had them
        prepare_quantized(cfg, model, resolved.gradient_checkpointing)
    model.config.use_cache = False
    if not folder.is_adapter and vocabulary > model.get_input_embeddings().weight.shape[0]:
        grow_embeddings(model, vocabulary)  # a base model next to a run that added tokens
    return model
