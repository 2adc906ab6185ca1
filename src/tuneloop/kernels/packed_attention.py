"""SDPA per sequence on packed rows: each sequence of a packed row attends on its own, causally, instead of the
whole row under one block-diagonal mask.

transformers runs a packed row (position_ids restarting at 0 for each sequence, no attention mask) through SDPA
with a dense mask built from the positions. The CPU kernel computes every block of that mask, so a 2048-token
row of seven sequences costs the attention of 2048 tokens, not of seven ~300-token ones. Split at the sequences,
the same attention costs Σ len² instead of width², plus a fixed cost per call. Measured on an AMD Zen 4 CPU
(2 threads, the embedded SmolLM2-135M's 9 heads of 64, bf16, forward and backward of the whole model): 1.72–1.83×
the step at 1 × 2048-token rows of ~300-token sequences, 1.12× at 2 × 512 of ~100, a tie at the quickstart's
4 × 256 of ~34 (where the per-call cost eats the gain).

Padded rows (no packing) go the same way on a CPU: transformers runs them under a mask of causality and the
padding's keys, and the CPU kernel computes each row's whole width² (no causal skipping under a mask); each row's
real tokens alone, causally, cost their own length² (right padding: nothing real attends to the padding, whose
outputs are zeros here and never read). One layer's forward and backward, 4 rows of 511 with 511, 480, 300 and 150
real tokens: 41 against 55 ms (4 heads, 1 thread); of 511, 250, 120, 60: 27 against 53 ms; four nearly equal rows
gain nothing, so the same cost model weighs it (`masked`: the mask's dense cost has no causal shortcut).

Registered under its own name in transformers' attention and mask interfaces, so the model loads with it like
any kernel (`attn_implementation`); resolved.py chooses it for packed runs, and for padded ones on a CPU. Under
torch.compile it runs eagerly (`torch.compiler.disable`), so the graph breaks at each layer's attention: torch
then compiles one layer's graph and reuses it for every layer. On the embedded model that compiled in 15–18 s
instead of the 71 s of the whole decoder as one graph; the steady steps ran 1.10× the eager ones at 4 × 256 (the
one graph: 1.14×), and at 1 × 1024 282 real tokens/s against 219 for the one graph under the mask. The mask
interface builds SDPA's own mask, so every forward this module does not split (no positions and no plain padding
mask, rows not worth it, a sliding window shorter than a sequence, left padding, a cache) runs exactly SDPA.
"""

from __future__ import annotations

PER_SEQUENCE_SDPA = "sdpa_per_sequence"

# The cost of one sequence's attention call beyond its len² work, in the units of one dense row's width²
# (forward and backward, measured on Zen 4 with 9 heads of 64): fp32 ~2000; bf16 was ~6000 when its short
# sequences ran through the math kernel (a 16-token sequence cost what a 77-token square of the dense kernel
# costs), and they now run in fp32 at 0.37× that call's time (0.15 against 0.41 ms): 6000 × 0.37 ≈ 2200. A batch
# is split only where that estimate is below SPLIT_MARGIN of the dense cost: near a tie the one call is kept.
CALL_COST = {"bf16": 2200, "fp32": 2000}
SPLIT_MARGIN = 0.8
# Under bf16, sequences shorter than this run in fp32 through SDPA's flash kernel (their q, k and v widened from
# bf16: kernels/sequences_apart.py), longer ones in bf16 through the same kernel. The CPU flash kernel's bf16 backward
# has a large fixed cost per call, and the math kernel upcasts every call's inputs itself (thousands of small casts a
# step). One layer's forward and backward, 9 heads of 64 over 3 kv heads, Zen 4, 2 threads, ms per sequence (bf16 math /
# bf16 flash / fp32 flash): 34 tokens 0.45 / 0.93 / 0.31, 128: 1.69 / 2.55 / 1.60, 256: 6.4 / 6.1 / 4.9, 384: 13.5 /
# 11.8 / 11.2, 512: 28.6 / 19.8 / 21.5, 1024: 137 / 43 / 55. Casting the quickstart's q, k and v to fp32 and back costs
# ~0.4 ms a tensor, forward and backward.
BF16_FLASH_FROM = 512

_registered = False


def loadable(name: str | None) -> str | None:
    """The attention name to load a model with; registers this module's kernel first where it is the one."""
    global _registered
    if name == PER_SEQUENCE_SDPA and not _registered:
        import torch
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        # eager inside a compiled model (its split is Python over each row's lengths): the graph breaks around it
        AttentionInterface.register(PER_SEQUENCE_SDPA, torch.compiler.disable(per_sequence_sdpa))
        AttentionMaskInterface.register(PER_SEQUENCE_SDPA, sdpa_mask)
        _registered = True
    return name


def model_can_split(model_config) -> bool:
    """Whether the model's class runs its attention through transformers' attention interface (it says so with
    `_supports_attention_backend`): others (Falcon's own table of classes, remote code) would fail to load under a
    registered name or ignore it. A vision-language model's class (LLaVA's, Idefics3's, ...) says it for its
    language model and its tower alike; the tower's attention is not causal, and runs SDPA unsplit here. A model
    with attention dropout is not split either: neither flash kernel (CPU, or the GPU's varlen) has dropout."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if float(getattr(text_config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    for auto_class in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            model_class = auto_class._model_mapping[type(model_config)]
        except (KeyError, ValueError):
            continue
        return bool(getattr(model_class, "_supports_attention_backend", False))
    return False


def packed_lengths(positions, width: int, rows: int | None = None) -> list[list[int]] | None:
    """The sequence lengths of each row of a packed batch, from its position_ids; None unless every row starts at
    position 0 and each position either follows the last by one or restarts at 0 (what tuneloop's collator and
    transformers' DataCollatorWithFlattening write; a left-padded batch's positions start at 1)."""
    import torch

    if positions is None or positions.dim() != 2 or positions.shape[1] != width or (
            rows is not None and positions.shape[0] != rows):  # (one row of positions broadcast over a batch)
        return None
    starts = positions == 0
    if not bool(starts[:, 0].all()) or not bool(((positions[:, 1:] - positions[:, :-1] == 1) | starts[:, 1:]).all()):
        return None
    lengths = []
    for row in starts:
        first = torch.nonzero(row).flatten().tolist() + [width]
        lengths.append([end - start for start, end in zip(first, first[1:])])
    return lengths


def attention_work(lengths: list[list[int]], width: int) -> tuple[int, int, int, int]:
    """What splitting weighs for a packed micro-batch: (Σ len² over its sequences, sequences, rows, width)."""
    return sum(n * n for row in lengths for n in row), sum(len(row) for row in lengths), len(lengths), width


def splits(work: tuple[int, int, int, int], dtype_name: str, masked: bool = False) -> bool:
    """Whether a micro-batch of this `attention_work` costs less apart than under one mask (see CALL_COST).
    `masked`: padded rows, which SDPA runs under the padding's mask (every row's width² computed)."""
    squares, sequences, rows, width = work
    if sequences == rows and not masked:
        return False  # one sequence per row: SDPA runs it causally without a mask already
    return squares + CALL_COST[dtype_name] * sequences < SPLIT_MARGIN * rows * width * width


def worth_splitting(lengths: list[list[int]], width: int, dtype_name: str) -> bool:
    return splits(attention_work(lengths, width), dtype_name)


def split_summary(works: list[tuple[int, int, int, int]], dtype_name: str, varlen: bool = False,
                  masked: bool = False) -> str:
    """The plan's words for a run's micro-batches: how many split, and the attention work left. `varlen`: a GPU
    run's packed micro-batches, which all go to torch's varlen flash kernel (it has no per-call cost to weigh).
    `masked`: padded rows (padded_attention_work), each row's real tokens apart."""
    split = [varlen or splits(work, dtype_name, masked) for work in works]
    done = sum(work[0] if apart else work[2] * work[3] ** 2 for work, apart in zip(works, split))
    whole = sum(work[2] * work[3] ** 2 for work in works)
    rest = len(works) - sum(split)
    kernel = "torch's varlen flash-attention kernel" if varlen else "sdpa"
    apart = "each row's real tokens on their own, without its padding," if masked else "each packed sequence on its own"
    return (f"{kernel}, {apart} in {sum(split)} of {len(works)} micro-batches"
            + (f" ({rest} under the row's mask, cheaper there)" if rest else "")
            + f": attention over {done / whole:.2f}× the positions of whole rows")


def padded_attention_work(lengths: list[int], width: int) -> tuple[int, int, int, int]:
    """attention_work of right-padded rows (one sequence each, then padding): weighed with `masked=True`."""
    return sum(n * n for n in lengths), len(lengths), len(lengths), width


def padded_lengths(mask, rows: int, width: int) -> list[int] | None:
    """Each row's real length in a right-padded batch, read from the 4-D boolean mask transformers builds for SDPA;
    None unless that mask is exactly causal attention over each row's first n keys, n ≥ 1 (left padding, a sliding
    window shorter than a row, bidirectional parts, a float mask: None, and SDPA runs under the mask as given)."""
    import torch

    if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
            or tuple(mask.shape) != (rows, 1, width, width)):
        return None
    lengths = mask[:, 0].any(dim=1).sum(dim=1)  # the keys some query attends to: a row's real tokens
    real = torch.arange(width, device=mask.device) < lengths[:, None]
    causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
    if not bool((lengths > 0).all()) or not torch.equal(mask[:, 0], causal[None] & real[:, None, :]):
        return None
    return lengths.tolist()


_last_split: tuple = (None, None)  # (position_ids, lengths or None): every layer of a forward sees the same rows
_last_padded: tuple = (lambda: None, None)  # (a weak reference to the 4-D mask, real lengths or None): the same for
# padded rows, without keeping a batch's [rows, 1, width, width] mask alive between forwards


def _split_of(positions, width: int, rows: int, dtype_name: str, weigh: bool = True):
    global _last_split
    if _last_split[0] is positions:
        return _last_split[1]
    lengths = packed_lengths(positions, width, rows)
    if lengths is not None and weigh and not worth_splitting(lengths, width, dtype_name):
        lengths = None
    _last_split = (positions, lengths)
    return lengths


def _padded_split_of(mask, rows: int, width: int, dtype_name: str):
    import weakref

    global _last_padded
    if mask is None:
        return None
    if _last_padded[0]() is mask:
        return _last_padded[1]
    lengths = padded_lengths(mask, rows, width)
    if lengths is not None and not splits(padded_attention_work(lengths, width), dtype_name, masked=True):
        lengths = None
    _last_padded = (weakref.ref(mask), lengths)
    return lengths


def per_sequence_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-interface signature: query (batch, heads, width, dim), key and value (batch,
    kv heads, width, dim); returns (batch, width, heads, dim) and no weights."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width = query.shape[2]
    lengths = None
    # (attention dropout: neither flash kernel has it, so the rows stay under SDPA's mask, as model_can_split says)
    splittable = (key.shape[2] == width and getattr(module, "is_causal", True) and is_causal is not False
                  and not dropout
                  and not any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks")))
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    # on a GPU the packed rows go to torch's varlen flash kernel in one call (16-bit); where that cannot run, the
    # rows stay under SDPA's mask (a loop of SDPA calls per sequence is far slower there)
    on_gpu = device != "cpu"
    if on_gpu and not (dtype in (torch.bfloat16, torch.float16) and varlen_kernel() is not None):
        splittable = False
    if splittable:
        lengths = _split_of(kwargs.get("position_ids"), width, query.shape[0],
                            "fp32" if dtype == torch.float32 else "bf16", weigh=not on_gpu)
        window = kwargs.get("sliding_window")
        if lengths is not None and window and max(n for row in lengths for n in row) > window:
            lengths = None
    padding = None  # padded rows (on a CPU): each row's real tokens apart, its padding's outputs zeros
    if splittable and lengths is None and not on_gpu:
        real = _padded_split_of(attention_mask, query.shape[0], width, "fp32" if dtype == torch.float32 else "bf16")
        if real is not None:
            lengths = [[n, width - n] if n < width else [n] for n in real]
            padding = [n < width for n in real]
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if on_gpu:
        return varlen_attention(query.to(dtype), key.to(dtype), value.to(dtype), lengths, scaling), None
    # each sequence through SDPA's CPU flash kernel, in the dtypes autocast would give SDPA (kernels/sequences_apart.py)
    from tuneloop.kernels.sequences_apart import sequences_apart

    pieces, ends = [], [0] * len(lengths)
    for b, row in enumerate(lengths):
        for i, n in enumerate(row):
            attended = not (padding and padding[b] and i == len(row) - 1)  # a padded row's last piece: its padding
            pieces.append((b, ends[b], n, attended))
            ends[b] += n
    with torch.autocast(device, enabled=False):
        return sequences_apart(query, key, value, pieces, scaling, dtype, BF16_FLASH_FROM if dtype != torch.float32
                               else 0), None


_varlen = None  # (torch's varlen_attn, the names of its parameters), looked up once; False where torch has none


def varlen_kernel():
    """torch's variable-length flash-attention kernel (`torch.nn.attention.varlen.varlen_attn`, CUDA only) and
    its parameter names, or None where this torch has none or no GPU runs it. Its signature changed between
    releases (is_causal in the first; window_size, scale and enable_gqa later): varlen_attention reads which."""
    global _varlen
    if _varlen is None:
        import inspect

        import torch

        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _varlen = False
        else:
            _varlen = (varlen_attn, set(inspect.signature(varlen_attn).parameters)) if torch.cuda.is_available() \
                else False
    return _varlen or None


def cumulative_lengths(lengths: list[list[int]], device):
    """The varlen kernel's cu_seqlens: where each sequence of the flattened rows starts, and the end (int32)."""
    import torch

    flat = [n for row in lengths for n in row]
    starts = torch.tensor([0] + flat, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return starts.to(device, non_blocking=True), max(flat)


def varlen_attention(query, key, value, lengths: list[list[int]], scaling=None):
    """Causal attention of each packed sequence on its own, the whole batch in one call of torch's varlen flash
    kernel: query (batch, heads, width, dim), key/value (batch, kv heads, width, dim), 16-bit; returns (batch,
    width, heads, dim). The kernel reads (tokens, heads, dim) with the rows laid end to end."""
    kernel, parameters = varlen_kernel()
    batch, heads, width, dim = query.shape
    q, k, v = (tensor.transpose(1, 2).reshape(batch * width, tensor.shape[1], dim) for tensor in (query, key, value))
    starts, longest = cumulative_lengths(lengths, query.device)
    options = {}
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if "enable_gqa" in parameters:
        options["enable_gqa"] = k.shape[1] != heads
    elif k.shape[1] != heads:  # (the first release: as many kv heads as query heads)
        k, v = (tensor.repeat_interleave(heads // tensor.shape[1], dim=1) for tensor in (k, v))
    if scaling is not None:
        if "scale" in parameters:
            options["scale"] = scaling
        elif abs(scaling * dim ** 0.5 - 1) > 1e-6:  # the kernel scales by 1/sqrt(dim): q carries the rest
            q = q * (scaling * dim ** 0.5)
    out = kernel(q, k, v, starts, starts, longest, longest, **options)
    return out.view(batch, width, heads, dim)
