"""Context parallel (`context_parallel_size`, and axolotl's older `sequence_parallel_degree`): each row's positions
split over the cp ranks of the device mesh. The attention is DeepSpeed's Ulysses (axolotl's ALST recipe).

The cp ranks of one data coordinate read the same rows (mesh.Mesh.data_rank); each takes one contiguous slice
of every row's positions (`ContextShare`): its tokens, their positions and their targets. Everything but attention
works per token, so the embeddings, norms, MLPs and the chunked loss run on the slice alone, and the activations a
rank holds fall by cp. Attention needs every position: DeepSpeed's `DistributedAttention` trades the slice of all
heads for all positions of 1/cp of the heads (one all-to-all each for q, k, v), the attention kernel runs on whole
rows, and a fourth all-to-all gives each rank its slice back (and the backward does the same in reverse).

The kernel behind it sees whole rows, so packed rows keep their sequences apart as on one process: the row's
whole position_ids ride to it as a keyword of the model's forward (transformers hands its keywords down to every
attention call), and SDPA per sequence (kernels/packed_attention.py) or SDPA causally over the row runs on them. Rows
are right-padded, so causal attention alone keeps every real token off the padding: no mask is made (the attention is
registered without a mask function, so transformers builds none from the slice's 2-D mask).

Targets are shifted by the collator before the split (targets[t] is the token position t predicts), so no slice
needs its neighbour's first token. Each rank's loss is its slice's sum; the gradients of the cp ranks add up to the
row's, and the engines average over data × cp ranks (DDP over every rank, FSDP2 shards over dp_shard × cp), so the
loop scales by that count (`plan.gradient_ranks`).
"""

from __future__ import annotations

from dataclasses import replace

from tuneloop.errors import UserError

ULYSSES = "tuneloop_ulysses"  # the attention name the model loads with under context parallel
WHOLE_POSITIONS = "context_whole_position_ids"  # the forward keyword carrying every position of the rows
KERNELS = ("sdpa", "sdpa_per_sequence", "flash_attention_2", "flash_attention_3")  # what runs behind the exchange

_inner: dict = {"kernel": None, "group": None, "exchange": None}


def context_parallel_words(cp: int) -> str:
    return (f"each row's positions split over {cp} context-parallel ranks (DeepSpeed's Ulysses attention: all-to-alls "
            "of q, k, v and the output per layer), which read the same rows")


def check_context_parallel(config, cp: int, sequence_len: int, kernel: str = "sdpa", tp: int = 1) -> None:
    """A UserError where `context_parallel_size: cp` cannot split this model's attention: the heads and key/value
    heads must divide over the cp ranks (each runs whole heads; under tensor parallel, whole heads of its tp rank's
    share), and a sliding window or the model's own attention
    code (no attention interface) is not what the exchange wraps. Read from the config alone (`plan`)."""
    key = f"config: `context_parallel_size: {cp}`"
    _check_kernel(kernel)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False) or hasattr(config, "vision_config"):
        kind = "an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "a vision-language"
        raise UserError(f"{key}: the {name} model is {kind} model, and tuneloop's context parallel splits a decoder's "
                        "rows of text; set context_parallel_size to 1")
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    ranks, by = tp * cp, f" × tensor_parallel_size {tp}" if tp > 1 else ""
    for what, size in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(size, int) and size % ranks:
            raise UserError(f"{key}{by} does not divide the model's {what} ({size}): Ulysses attention gives each cp "
                            f"rank whole heads of every position; pick sizes whose product divides {heads} and "
                            f"{kv_heads}")
    if sequence_len % cp:
        raise UserError(f"{key} does not divide `sequence_len: {sequence_len}`: each cp rank holds an equal slice "
                        f"of every row; make sequence_len a multiple of {cp}")
    windows = [kind for kind in (getattr(text, "layer_types", None) or []) if kind != "full_attention"]
    if windows or getattr(text, "use_sliding_window", False):
        raise UserError(f"{key}: the {name} model has {windows[0] if windows else 'sliding-window'} layers, which "
                        "the Ulysses exchange does not wrap (it runs causal attention over whole rows); set "
                        "context_parallel_size to 1")
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        model_class = None
    if model_class is None or not getattr(model_class, "_supports_attention_backend", False):
        raise UserError(f"{key}: the {name} model does not run its attention through transformers' attention "
                        "interface, where the exchange sits; set context_parallel_size to 1")


def loadable(kernel: str) -> str:
    """The attention name to load the model with: the exchange, around `kernel` (packed_attention.loadable has
    registered it already where it is tuneloop's own)."""
    _check_kernel(kernel)
    from transformers import AttentionInterface

    _inner["kernel"] = kernel
    AttentionInterface.register(ULYSSES, _ulysses_attention)
    return ULYSSES


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise UserError(f"config: context parallel runs attention kernels that take whole rows ({', '.join(KERNELS)})"
                        f", and this run's is {kernel}: remove `eager_attention`/`attn_implementation`, or set "
                        "context_parallel_size to 1")


def join(group) -> None:
    """The cp process group the exchange runs over (every rank calls it once the engine has made the mesh)."""
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.comm.init_distributed(dist_backend=_backend(group), auto_mpi_discovery=False, verbose=False)
    # batch-first layout [batch, positions, heads, dim]: scatter the heads (2), gather the positions (1)
    _inner["group"] = group
    _inner["exchange"] = DistributedAttention(_kernel_on_whole_rows, group, scatter_idx=2, gather_idx=1)


def _backend(group) -> str:
    import torch.distributed as dist

    return dist.get_backend(group)


def _ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-interface signature: query (batch, heads, slice, dim), key and value (batch, kv heads,
    slice, dim); returns (batch, slice, heads, dim)."""
    exchange = _inner["exchange"]
    if exchange is None:
        raise RuntimeError("context parallel attention ran before its process group was joined")
    whole_positions = kwargs.pop(WHOLE_POSITIONS, None)
    if whole_positions is None:
        raise RuntimeError(f"context parallel attention needs `{WHOLE_POSITIONS}` in the model's forward keywords")
    kwargs["position_ids"] = whole_positions
    # [batch, heads, slice, dim] -> [batch, slice, heads, dim]: the exchange's batch-first layout
    query, key, value = (tensor.transpose(1, 2) for tensor in (query, key, value))
    output = exchange(query, key, value, 0, None, module, kwargs)
    return output, None


def _kernel_on_whole_rows(query, key, value, module, kwargs):
    """The kernel on whole rows of this rank's heads: in [batch, positions, heads, dim], out the same. SDPA gets the
    block-diagonal mask of packed rows (transformers builds none for this attention: see the module docstring);
    SDPA per sequence splits them itself where that is cheaper and takes the mask where not; flash-attention reads
    the sequences off the positions (its varlen path)."""
    from transformers import AttentionInterface

    name = _inner["kernel"]
    kernel = AttentionInterface()[name]
    mask = packed_mask(kwargs["position_ids"]) if name.startswith("sdpa") else None
    query, key, value = (tensor.transpose(1, 2) for tensor in (query, key, value))
    output, _ = kernel(module, query, key, value, mask, **kwargs)
    return output


_last_mask: tuple = (None, None)  # (whole positions, their mask): every layer of a forward sees the same rows


def packed_mask(positions):
    """The causal block-diagonal mask [rows, 1, width, width] (True: attend) of rows whose positions restart at 0
    for each sequence; None where every row holds one sequence (causal attention alone is exact there: rows are
    right-padded)."""
    import torch

    global _last_mask
    if _last_mask[0] is positions:
        return _last_mask[1]
    starts = positions == 0
    mask = None
    if bool((starts.sum(1) > 1).any()):
        sequence = starts.cumsum(1)
        width = positions.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril()
        mask = ((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]
    _last_mask = (positions, mask)
    return mask


class ContextShare:
    """This rank's slice of every row of a micro-batch (a MicroBatch from data/collate.py, on the host)."""

    def __init__(self, cp: int, index: int):
        self.cp, self.index = cp, index

    def __call__(self, batch):
        inputs = dict(batch.inputs)
        input_ids = inputs["input_ids"]
        rows, width = input_ids.shape
        if width % self.cp:  # (the collator's padding multiple includes cp: data/collate.py)
            raise RuntimeError(f"a micro-batch of width {width} does not split over {self.cp} cp ranks")
        positions = inputs.pop("position_ids", None)
        mask = inputs.pop("attention_mask", None)
        if positions is None:
            import torch

            if mask is not None and not bool((mask[:, 1:] <= mask[:, :-1]).all()):  # (a real token after padding)
                raise RuntimeError("context parallel needs right-padded rows")
            positions = torch.arange(width).expand(rows, width)
        share = slice(self.index * width // self.cp, (self.index + 1) * width // self.cp)
        inputs = {"input_ids": input_ids[:, share], "position_ids": positions[:, share].contiguous(),
                  WHOLE_POSITIONS: positions.contiguous()}
        # the counts stay the whole micro-batch's: the loop divides sums over ranks by the ranks that share rows
        return replace(batch, inputs=inputs, targets=batch.targets[:, share].contiguous())
