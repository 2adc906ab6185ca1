"""The plan in words: what `tuneloop plan` and `train` print, numbers first. The arithmetic is build.py's."""

from __future__ import annotations

from tuneloop.rl_methods import PROCESS_REWARD_OBJECTIVE


def describe(plan) -> str:
    """The human-readable plan: a short report, numbers first."""
    if plan.streamed:
        return _describe_streamed(plan)
    if plan.rollout is not None:
        return _describe_online(plan)
    rows = "pairs" if plan.unit == "pairs" else "rows"
    batch_rows, per_step = rows, ""
    budget, at_most = "", ""
    if plan.batching == "packed" and plan.unit != "tokens":  # a packed row holds several pairs (KTO: rows)
        batch_rows = "packed rows"
        per_step = f" (~{(plan.train_rows - plan.rows_cut_per_epoch) / plan.steps_per_epoch:.1f} {rows} per step)"
    elif plan.batching.startswith("token_budget"):  # fewer rows where they are long
        at_most = "at most "
        per_step = f" (~{(plan.train_rows - plan.rows_cut_per_epoch) / plan.steps_per_epoch:.1f} {rows} per step)"
        budget = (f"at most {plan.train_batching.token_budget} tokens a micro-batch as padded, "
                  f"the largest {plan.max_micro_batch_tokens}; ")
    density = (f"packing efficiency {plan.packing_efficiency:.1%}" if plan.packing_efficiency is not None
               else f"padding {plan.padding_fraction:.1%} of computed tokens")
    lines = [
        "tuneloop plan",
        *_model_lines(plan),
        f"  world size           {plan.world_size}",
        f"  batch                {at_most}{plan.micro_batch_size} {batch_rows}/micro-batch × "
        f"{plan.gradient_accumulation_steps} accumulation × {data_ranks_words(plan)} = {at_most}"
        f"{plan.global_batch_size} {batch_rows} per optimizer step" + per_step,
        f"  batching             {plan.batching} ({budget}sequence_len {plan.sequence_len}; {density})",
        f"  data                 {plan.train_rows} train {rows}, {plan.train_tokens} tokens, "
        f"{plan.trainable_tokens} trained tokens per epoch; {plan.eval_rows} eval {rows}",
        f"  steps                {plan.steps_per_epoch} per epoch ({plan.micro_batches_per_epoch} micro-batches "
        f"per rank), {plan.total_steps} in total = {plural(plan.epochs_covered, 'epoch')}"
        + (" (a share of an epoch: its steps rounded up)" if plan.epochs_covered % 1 else ""),
        f"  tokens               {plan.tokens_per_step:.0f} trained tokens per step, "
        f"{plan.total_trainable_tokens} over the run",
        f"  optimizer            {_optimizer(plan)}, learning rate {plan.learning_rate:g}, {plan.lr_scheduler} schedule, "
        f"warm-up {plural(plan.warmup_steps, 'step')}",
    ]
    lines += _machine_lines(plan)
    return "\n".join(lines)


def _model_lines(plan) -> list[str]:
    """The model (its class, size and weights, a 4/8-bit base's loading) and the adapter trained on it."""
    return ([f"  model                {plan.model}"] if plan.model else []) + (
        [f"  adapter              {plan.adapter}"] if plan.adapter else [])


def _describe_streamed(plan) -> str:
    rows = "full rows" if plan.packing_efficiency else "rows"
    tokens = (f"{plan.total_real_tokens // plan.total_steps} tokens per step ({plan.global_batch_size} × "
              f"{plan.sequence_len}), {plan.total_real_tokens} over the run" if plan.total_real_tokens is not None
              else "each row as long as it is (padded to the longest of its micro-batch)")
    lines = [
        "tuneloop plan",
        *_model_lines(plan),
        f"  world size           {plan.world_size}",
        f"  batch                {plan.micro_batch_size} {rows}/micro-batch × {plan.gradient_accumulation_steps} "
        f"accumulation × {data_ranks_words(plan)} = {plan.global_batch_size} {rows} per optimizer step",
        f"  batching             {plan.batching} (sequence_len {plan.sequence_len})",
        "  data                 streamed: each rank reads its own share of the rows as the run goes; passes over "
        f"the data and trained tokens are counted as they come; {plan.eval_rows} eval rows",
        f"  steps                {plan.total_steps} (max_steps)",
        f"  tokens               {tokens}",
        f"  optimizer            {_optimizer(plan)}, learning rate {plan.learning_rate:g}, {plan.lr_scheduler} schedule, "
        f"warm-up {plural(plan.warmup_steps, 'step')}",
    ]
    return "\n".join(lines + _machine_lines(plan))


UNIT_WORDS = {"completion_tokens": "the completion tokens of the step (every rank)",
              "completions": "the completions of the step, each weighed alike",
              "micro_batches": "each micro-batch's own completion tokens, then the step's micro-batches (TRL's bnpo)"}


def _describe_online(plan) -> str:
    """Online RL: micro_batch_size counts completions (as in TRL); the generated tokens are an upper bound."""
    r = plan.rollout
    reference = plan.reference or "none (trl.beta is 0: no KL term)"
    lines = [
        "tuneloop plan",
        *_model_lines(plan),
        f"  world size           {plan.world_size}",
        f"  batch                {plan.micro_batch_size} completions/micro-batch × {plan.gradient_accumulation_steps} "
        f"accumulation × {data_ranks_words(plan)} = {plan.global_batch_size} completions per optimizer step "
        f"= {r['prompts_per_step']} prompts × {r['num_generations']} generations",
        f"  prompts              {plan.train_rows} ({plan.train_tokens} tokens), in a seeded shuffle per epoch; "
        f"{plan.rows_cut_per_epoch} per epoch fill no whole step and wait for the next",
        f"  steps                {plan.steps_per_epoch} per epoch ({r['num_iterations']} per generation), "
        f"{plan.total_steps} in total = {plural(plan.epochs_covered, 'epoch')}; {r['generations']} generations",
        f"  generation           {_engine_words(r)}, {r['completions_per_rank']} "
        f"completions per rank per generation, at most {_cap_words(r)} tokens each: at most "
        f"{r['generated_tokens_at_most']} generated tokens over the run",
        *_vllm_lines(r),
        *_feature_lines(r),
        f"  rewards              {', '.join(r['reward_funcs'])}; {r['aggregation'].replace('_', ' ')}, scaled "
        f"by {r['scale_rewards']} std{_unscored_words(r)}",
        f"  objective            {plan.objective}, loss_type {r['loss_type']}: averaged over "
        f"{UNIT_WORDS[r['unit']]}; reference {reference}",
        f"  optimizer            {_optimizer(plan)}, learning rate {plan.learning_rate:g}, {plan.lr_scheduler} schedule, "
        f"warm-up {plural(plan.warmup_steps, 'step')}",
    ]
    return "\n".join(lines + _machine_lines(plan))


def _unscored_words(r: dict) -> str:
    """When the run stops for steps that no reward function scores (each advantage 0: nothing trains)."""
    allowed = r.get("unscored_steps_allowed")
    if allowed is None:
        return ""
    if allowed == 0:
        return "; a step no function scores stops the run (trl.unscored_steps_allowed: 0)"
    return f"; {plural(allowed, 'step')} in a row that no function scores, then the run stops (trl.unscored_steps_allowed)"


def _cap_words(r: dict) -> str:
    caps = r.get("completion_caps")
    if not caps:
        return str(r["max_completion_length"])
    multiplier = r["feature_matching"]["adaptive_max_tokens"]
    span = f"{caps[0]}" if caps[0] == caps[1] else f"{caps[0]}–{caps[1]}"
    return (f"{span} (EBFT's adaptive cap: {multiplier:g} × each step's longest reference answer, 64 to "
            f"max_completion_length {r['max_completion_length']})")


def _feature_lines(r: dict) -> list[str]:
    """`rl: ebft`: what its feature-matching reward reads and how it scores."""
    f = r.get("feature_matching")
    if not f:
        return []
    compared = "whitened per group (SVD)" if f["whitening"] else "L2-normalised"
    return [f"  features             hidden states after layers {', '.join(map(str, f['feature_layers']))} of "
            f"{f['num_hidden_layers']}, {f['embed_method']} pooled, {compared}; from {f['features_from']}",
            f"  ebft reward          {f['alignment_coef']:g} × 2·cos(completion, reference answer) − "
            f"{f['diversity_coef']:g} × 2·mean similarity to the group's other completions"]


def _engine_words(r: dict) -> str:
    if r.get("engine") != "vllm":
        return "transformers generate (KV cache, left-padded)"
    return f"vLLM server at {r['server']} serving {r['served_model']}"


def _vllm_lines(r: dict) -> list[str]:
    """What proves the server sampled from the trained weights, and what corrects the rest of the mismatch."""
    if r.get("engine") != "vllm":
        return []
    sync = {"full": "every weight", "merged": "the LoRA adapter merged into the base weights",
            "adapter": "the LoRA adapter (the server's LoRA path)"}[r["weight_sync"]]
    check = (f"the server's log-probs of its tokens vs the trainer's, {r['logprob_gap_checked_by']} |Δ| ≤ "
             f"{r['logprob_tolerance']:g} or the run stops" if r["gap_checked"] else "logged, not checked (top-k/top-p/min-p or a regex change the "
             "sampled distribution, so the log-probs differ by design)")
    correction = r["importance_sampling"]
    lines = [f"  weight sync          {sync}, sent before each generation (files under output_dir/vllm_weights)",
             f"  log-prob gap         {check}",
             "  importance sampling  " + (f"{correction['mode']}, ratios in [{correction['clip_min']}, "
                                          f"{correction['clip_max']}]" if correction else "off")]
    if r["staleness"]:
        lines.append("  async                the next step's completions are generated while this one trains, from "
                     "weights one step old (the gap then holds that step's change: logged, checked on the first)")
    return lines


def _machine_lines(plan) -> list[str]:
    """The plan's lines after the data's: precision, compute, engine, memory, evals, saves, drops, warnings."""
    lines = []
    if plan.encoder_tokens is not None:
        lines.append(f"  encoder-decoder      encoder {plan.encoder_tokens} tokens (padding "
                     f"{plan.encoder_padding_fraction:.1%}), decoder {plan.decoder_tokens} tokens (padding "
                     f"{plan.decoder_padding_fraction:.1%}) over the run")
    if plan.objective == PROCESS_REWARD_OBJECTIVE:  # (train/process_reward_model.py)
        lines.append(f"  objective            {plan.objective}: each reasoning step's end token classified correct or "
                     "incorrect (2 labels), the cross-entropy averaged over the labelled step ends of each optimizer "
                     "step; no reference")
    elif plan.objective != "language_model" and plan.rollout is None:
        together = ("chosen and rejected" if plan.unit == "pairs"
                    else "each row's reply and its mismatched reply for the KL estimate")
        lines.append(f"  objective            {plan.objective}: loss averaged over the {plan.unit} of each step "
                     f"({together} in one micro-batch); reference {plan.reference or 'none'}")
    if plan.precision is not None:
        lines.append(f"  precision            {plan.precision}; attention {plan.attention}")
    if plan.qat is not None:
        lines.append(f"  qat                  {plan.qat}")
    if plan.attention_split is not None:
        lines.append(f"  attention            {plan.attention_split}")
    if plan.host_allocator is not None:
        lines.append(f"  host memory          {plan.host_allocator}")
    if plan.torch_compile_choice is not None:
        lines.append(f"  compile              {plan.torch_compile_choice}")
    if plan.torch_compile is not None:
        lines.append(f"  compile              {plan.torch_compile}: the first step compiles (it can take a minute) "
                     "and is timed apart; widths rounded up to multiples of 64")
    if plan.peak_source is not None:
        lines.append(f"  compute              {_compute_line(plan)}")
    if plan.engine is not None:
        lines.append(f"  engine               {plan.engine}")
    if plan.mesh is not None:
        lines.append(f"  device mesh          {plan.mesh}")
    if plan.communication is not None and plan.world_size > 1:
        lines.append(f"  communication        per rank per step: {plan.communication['words']}")
    if plan.saved_dtype is not None:
        lines.append(f"  saved                the model's weights in {plan.saved_dtype} (safetensors), as trained: the same "
                     "under every engine")
    lines += [
        f"  memory               {_memory_line(plan)}",
        f"  evals                {plan.eval_count} (at steps {_short(plan.eval_steps_at)})",
        f"  saves                " + (f"up to {plan.save_count}, at the evals that improve {plan.saves_at_best}"
                                          if plan.saves_at_best else str(plan.save_count))
        + f" (at steps {_short(plan.save_steps_at)})",
    ]
    if plan.final_model is not None:
        lines.append(f"  final model          {plan.final_model}")
    if plan.push is not None:
        lines.append(f"  push                 {plan.push}")
    dropped = [f"{plan.dropped_too_long} longer than sequence_len"] if plan.dropped_too_long else []
    if plan.dropped_no_trained_tokens:
        dropped.append(f"{plan.dropped_no_trained_tokens} with no trained token")
    if plan.dropped_identical_pairs:
        dropped.append(f"{plan.dropped_identical_pairs} pairs whose chosen and rejected replies are the same")
    if plan.dropped_too_short:
        dropped.append(f"{plan.dropped_too_short} shorter than min_sample_len")
    if plan.dropped_duplicates:
        dropped.append(f"{plan.dropped_duplicates} repeating an earlier row (dataset_exact_deduplication)")
    if dropped:
        lines.append(f"  dropped rows         {'; '.join(dropped)}")
    for warning in plan.warnings:
        lines.append(f"  warning: {warning}")
    return lines


def _compute_line(plan) -> str:
    if plan.flops_per_token is None:
        return f"MFU {plan.peak_source}"
    vision = f"; {plan.vision_flops['words']}" if plan.vision_flops else ""
    return (f"{plan.flops_per_token / 1e9:.3g} GFLOP per real token (attention over {plan.attention_context:g} "
            f"positions on average){vision}; MFU against {plan.peak_source}")


def _memory_line(plan) -> str:
    if plan.memory is None:
        return "not estimated"
    m = plan.memory
    device = f" of {m['device_gb']:.0f} GB on {m['device']}" if m["device_gb"] else ""
    per_rank = " per rank" if m.get("world_size", 1) > 1 else ""
    after = (f" in the backward, {m['gradients_after_backward_gb']:.2f} in fp32 after it"
             if m.get("gradients_after_backward_gb") else "")
    process = f"the process's libraries {m['process_gb']:.2f}, " if m.get("process_gb") else ""
    process += f"matmul kernel caches {m['kernel_caches_gb']:.2f}, " if m.get("kernel_caches_gb") else ""
    return (f"~{m['total_gb']:.2f} GB{per_rank}{device} ({process}weights {m['weights_gb']:.2f}, gradients "
            f"{m['gradients_gb']:.2f}{after}, optimizer {m['optimizer_gb']:.2f}, activations {m['activations_gb']:.2f}"
            + (f" (the vision tower's {m['vision_activations_gb']:.2f})" if m.get("vision_activations_gb") else "")
            + (f", gathered layers {m['gathered_gb']:.2f}" if m.get("gathered_gb") else "")
            + (f", reference copy {m['reference_gb']:.2f}" if m.get("reference_gb") else "")
            + (f"; generation's KV cache {m['generation_gb']:.2f}, held while the activations are not"
               if m.get("generation_gb") else "")
            + (f"; {m['host_gb']:.2f} GB offloaded to host memory" if m.get("host_gb") else "") + "; "
            f"{m['trainable_parameters']:,} of "
            f"{m['parameters']:,} parameters trained)")


def data_ranks_words(plan) -> str:
    """The ranks that read rows, as the batch line multiplies by them: every rank, or (tensor parallel) fewer."""
    if plan.data_ranks == plan.world_size:
        return plural(plan.world_size, "rank")
    sharing = "context-parallel" if getattr(plan, "context_ranks", 1) > 1 else "tensor-parallel"
    return f"{plural(plan.data_ranks, 'data rank')} (of {plan.world_size}: {sharing} ranks share their rows)"


def plural(count: float, word: str) -> str:
    return f"{count:g} {word}" if count == 1 else f"{count:g} {word}s"


def _short(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{', '.join(map(str, steps[:6]))}, …, {steps[-1]}"


def _optimizer(plan) -> str:
    return plan.optimizer + (f" {plan.optimizer_steps}" if plan.optimizer_steps else "")
