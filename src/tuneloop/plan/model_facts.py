"""What the plan knows of the model (ModelFacts), counted from the model built on the meta device. The model has its
adapter or freezing; counted are its parameters, matmul weights, quantizable layers, experts and vision side;
sequence_len is checked against its positions."""

from __future__ import annotations

from dataclasses import dataclass

from tuneloop.config import TuneloopConfig
from tuneloop.errors import UserError
from tuneloop.model.kinds import VISION_LANGUAGE, ModelKind
from tuneloop.model.model_config import model_class, model_config
from tuneloop.model.vision import freeze_vision_modules

@dataclass
class ModelFacts:
    """What the plan needs to know of the model, read from its config alone (no weights)."""

    config: object  # the transformers config
    parameters: int
    trainable_parameters: int  # all of them, the adapter's, or the unfrozen ones
    max_positions: int | None  # n_positions / max_position_embeddings, where the config has one
    learned_positions: bool  # a position-embedding table of max_positions rows: longer rows cannot run at all
    chunked_loss: bool = False  # the loss meets the output projection in chunks (no whole logits tensor)
    matmul_weights: tuple[int, int] = (0, 0)  # (frozen, trained) weights tokens are multiplied by: plan/flops.py
    grown_rows: int = 0  # embedding rows added for the tokenizer's tokens the model's vocabulary does not have
    embedding_rows: int = 0  # the model's own rows, before any was added
    embeddings_trained: bool = True  # the input embeddings are trained (not under LoRA without modules_to_save)
    # trained weights only matmuls read: held in bf16 beside fp32 masters under bf16 (engines/masters.py)
    matmul_only_trained: int = 0
    matmul_only_frozen: int = 0  # the frozen ones: held in bf16 under bf16 beside an adapter (engines/masters.py)
    hidden_matrices_trained: int = 0  # trained weights Muon orthogonalises (muon.is_hidden_matrix): its states
    # (weights, trained) of the output projection the chunked loss meets; (0, False) without the chunked loss
    head_weights: tuple[int, bool] = (0, False)
    module_classes: frozenset = frozenset()  # the class names of the model's modules (an engine checks its own)
    layer_classes: tuple = ()  # the model's decoder-layer classes (transformers' _no_split_modules)
    quantizable: tuple[int, int, int] = (0, 0, 0)  # (weights, rows, layers) of the linears 4/8-bit loading quantizes
    experts: tuple[int, int] = (0, 0)  # (weights, tensors) of the 3-D expert weights (quantize_moe_experts)
    vision: object = None  # a vision-language model's image side as plan/flops.py counts it (VisionWeights)
    # what LLaMA-formula decoder layers keep for the backward (plan/activations.py); None for other models
    decoder_layers: object = None
    fan_in_fan_out_note: str | None = None  # `lora_fan_in_fan_out` the layers contradict (adapters.py), in words

    @property
    def text_config(self):
        """The config that holds the language model's sizes (hidden, layers, heads, vocabulary): a composite
        config's text part (Gemma 4, Qwen3.5), else the config itself."""
        return sizes_config(self.config)

def sizes_config(config):
    """The config whose global sizes the plan reads: a composite's text part, and for a heterogeneous one (per-layer
    head sizes, Gemma 4) a copy that answers with the global values (the estimates need one figure; transformers
    refuses to give it, or warns once per key, unless asked for it)."""
    import copy
    import logging

    sizes = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(sizes, "allow_global_per_layer_attribute_access", True) is False:
        sizes = copy.copy(sizes)
        sizes.allow_global_per_layer_attribute_access = True
        logging.getLogger("transformers.integrations.heterogeneity.configuration_utils").setLevel(logging.ERROR)
    return sizes

def model_facts(cfg: TuneloopConfig, kind: ModelKind, tokenizer=None) -> ModelFacts:
    """The model built on the meta device (no memory, no weights read), with the adapter or the freezing it
    will train with, so the counts are the real ones."""
    import torch

    from tuneloop.adapters import add_adapter, fan_in_fan_out_note, freeze_all_but
    from tuneloop.engines.masters import matmul_only_weights
    from tuneloop.quant.mxfp4 import dequantizes_mxfp4
    from tuneloop.kernels.output_head import loss_meets_head_in_chunks, output_head
    from tuneloop.plan.activations import llama_decoder_layers
    from tuneloop.quant.quantized_experts import count_expert_weights, expert_parameter_names, expert_targets

    config = model_config(cfg, tokenizer)
    dequantizes_mxfp4(cfg, config)  # (an MXFP4 checkpoint and the MXFP4 keys go together: refused now, not at load)
    try:
        with torch.device("meta"):
            built = model_class(cfg, kind)
            model = (built.from_config(config, trust_remote_code=cfg.trust_remote_code) if hasattr(built, "from_config")
                     else built._from_config(config))  # a concrete class (model_type: LlamaForCausalLM)
    except (OSError, ValueError) as error:
        raise UserError(f"model: cannot build {cfg.base_model!r} from its config: {error}") from None
    grown = len(tokenizer) - model.get_input_embeddings().num_embeddings if tokenizer is not None else 0
    if grown > 0:
        with torch.device("meta"):  # (mean-initialising new rows reads values: there are none on meta)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    embedding_name = next(name for name, module in model.named_modules() if module is model.get_input_embeddings())
    quantizable = quantizable_linears(cfg, model)
    if cfg.qat is not None:  # a group size the layers' widths do not take: refused by the plan, before training
        from tuneloop.quant.qat import check_fits

        check_fits(cfg.qat, model)
    experts = count_expert_weights(model)
    if cfg.quantize_moe_experts and not experts[1]:
        raise UserError(f"config: `quantize_moe_experts: true`, but {cfg.base_model} ({type(model).__name__}) has no "
                        "expert weights to quantize (3-D parameters named like `experts.gate_up_proj`): remove the key")
    if cfg.quantize_moe_experts and cfg.lora_target_parameters:  # what `train` would refuse, refused by the plan
        expert_targets(cfg.lora_target_parameters, expert_parameter_names(model))
    classes = frozenset(type(module).__name__ for module in model.modules())
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    parameters = sum(p.numel() for p in model.parameters())
    sizes = sizes_config(config)
    max_positions = getattr(sizes, "n_positions", None) or getattr(sizes, "max_position_embeddings", None)
    inputs = model.get_input_embeddings()
    learned = max_positions is not None and any(
        isinstance(module, torch.nn.Embedding) and module is not inputs and module.num_embeddings == max_positions
        for module in model.modules())
    layout_note = None
    if cfg.adapter:
        model = add_adapter(cfg, model, kind.peft_task_type)
        layout_note = fan_in_fan_out_note(cfg, model)
    elif cfg.unfrozen_parameters:
        freeze_all_but(model, cfg.unfrozen_parameters)
    if cfg.freeze_mm_modules:
        freeze_vision_modules(cfg, model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embeddings_trained = any(parameter.requires_grad and embedding_name in name  # (peft prefixes the names)
                             for name, parameter in model.named_parameters())
    chunked = loss_meets_head_in_chunks(cfg, model)
    head = output_head(model)[1] if chunked else None
    decoder_layers = llama_decoder_layers(model, getattr(sizes, "num_hidden_layers", 0) or 0)
    return ModelFacts(config, parameters, trainable, max_positions, learned, chunked,
                      count_matmul_weights(model), grown_rows=max(grown, 0),
                      head_weights=(head.numel(), head.requires_grad) if head is not None else (0, False),
                      embedding_rows=len(tokenizer) - grown if tokenizer is not None else 0,
                      embeddings_trained=embeddings_trained,
                      matmul_only_trained=sum(p.numel() for p in matmul_only_weights(model, cfg)),
                      matmul_only_frozen=sum(p.numel() for p in matmul_only_weights(model, cfg, trained=False)),
                      hidden_matrices_trained=hidden_matrices_trained(model),
                      module_classes=classes, layer_classes=layer_classes, quantizable=quantizable, experts=experts,
                      vision=_vision_weights(cfg, kind, model, config, tokenizer), decoder_layers=decoder_layers,
                      fan_in_fan_out_note=layout_note)

def _vision_weights(cfg: TuneloopConfig, kind: ModelKind, model, config, tokenizer=None):
    """A vision-language model's image side, stage by stage, for the plan's FLOPs (plan/flops.py), with the run's
    image processor where the tokenizer carries it (Gemma 4's tower runs as many positions as it says)."""
    if kind != VISION_LANGUAGE:
        return None
    from tuneloop.data.images import image_inputs_of, vision_family
    from tuneloop.plan.flops import vision_weights

    images = image_inputs_of(tokenizer)
    return vision_weights(model, config, vision_family(config, cfg.base_model or cfg.base_model_config),
                          images.image_processor if images is not None else None)

def hidden_matrices_trained(model) -> int:
    from tuneloop.muon import is_hidden_matrix

    return sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(name, p))

def quantizable_linears(cfg: TuneloopConfig, model) -> tuple[int, int, int]:
    """(weights, output rows, layers) of the layers bitsandbytes quantizes when loading, by transformers' own rule:
    every Linear (and GPT-2's Conv1D) but those its skip patterns match — `llm_int8_skip_modules` when given (it
    replaces the default), else the output head and tied weights."""
    import torch
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = (cfg.bnb_config_kwargs or {}).get("llm_int8_skip_modules")
    patterns = list(skip) if skip is not None else get_keys_to_not_convert(model)
    weights = rows = layers = 0
    for name, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D"
        if (isinstance(module, torch.nn.Linear) or conv1d) and should_convert_module(name, patterns):
            weights += module.weight.numel()
            rows += module.weight.shape[1] if conv1d else module.out_features
            layers += 1
    return weights, rows, layers

def count_matmul_weights(model) -> tuple[int, int]:
    """(frozen, trained) weights of the matrices tokens are multiplied by: every Linear (an adapter's too, and
    a tied output head once) and GPT-2's Conv1D; embeddings are looked up, not multiplied (plan/flops.py)."""
    import torch

    frozen = trained = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or not (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        if weight.requires_grad:
            trained += weight.numel()
        else:
            frozen += weight.numel()
    return frozen, trained

def check_sequence_len(cfg: TuneloopConfig, facts: ModelFacts) -> str | None:
    """A refusal when rows longer than the model's position table would crash mid-training; a warning (returned)
    when only the trained context length is exceeded (rotary positions extrapolate, often badly)."""
    limit = facts.max_positions
    if limit is None or cfg.sequence_len <= limit:
        return None
    if facts.learned_positions:
        raise UserError(f"config: `sequence_len: {cfg.sequence_len}` is longer than the {limit} positions this model "
                        f"has ({cfg.base_model or cfg.base_model_config}: a learned position table); set sequence_len "
                        f"to {limit} or less")
    return (f"sequence_len={cfg.sequence_len} is above the model's max_position_embeddings={limit}: positions past "
            f"{limit} were never trained; quality may drop on rows that long.")
