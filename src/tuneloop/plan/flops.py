"""Model FLOPs utilisation (MFU): the share of the machine's peak that the run turns into the model's work.

Model FLOPs per real token, counted from the model as it is built (model_facts.py's meta-device copy, adapter included;
model_facts.count_matmul_weights):

- each weight matrix a token passes through costs 2 FLOPs per weight in the forward, 2 in the backward for the
  gradient of its input, and 2 more for the gradient of the weight when it is trained: 6 per weight in a full
  fine-tune, 4 per frozen weight under LoRA;
- attention's two products (scores, weighted values) cost 4 FLOPs per layer, attention width and position
  attended to in the forward, three times that with the backward. A causal token attends to itself and the
  tokens before it in its own sequence (packing keeps sequences apart), so averaged over the data's tokens it
  attends to Σ len·(len+1)/2 / Σ len positions: the count the data needs, not the padded width;
- recomputation (gradient checkpointing) is not counted: MFU counts the model's work, not what the hardware redid;
- the output head is counted for the positions it meets: under the chunked loss only those with a target
  (train/chunked_loss.py), every position otherwise.
- a vision-language model's language model is counted so per token, image tokens included; its vision tower and
  projector per image, from the positions they run (with_images; the notes above VisionWeights), and the plan
  says their share of a step's FLOPs.

The peak: the vendor's dense bf16/fp16 tensor-core figure for GPUs this table knows, one per rank; otherwise,
and on every CPU, the best of a few square matmuls at the run's precision on this machine. On a CPU the ranks
of a host share its cores, so the host is the device, and the probe runs on as many threads as the run uses
there (each rank's threads × the ranks on the host, at most the host's cores): the peak of what the run was
given. Measured once per device, thread count, precision and torch version, and cached. `peak_tflops` (per
GPU, or per host's CPU) overrides both.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tuneloop.cache import cache_root
from tuneloop.vision_families import VISION_FAMILIES

# dense (not sparse) bf16/fp16 tensor-core TFLOPS from the vendors' data sheets; the first name found in the
# device's name wins (so "H100 PCIe" is looked up before "H100")
GPU_PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("B200", 2250.0),
                   ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]
PROBE_SIZE = {"cpu": 2048, "cuda": 8192}  # long enough to reach the matmul's speed, short enough to run in ~1 s
PROBE_REPEATS = 10
PROBE_PRODUCT_SECONDS = 0.2  # the longest one CPU probe product may take (a slow dtype is probed smaller)
PEAK_CACHE = "peak_flops.json"
PEAK_CACHE_ENV = "TUNELOOP_PEAK_FLOPS"  # another file for the figures (the test suite keeps its own)
# a probe that ran beside other work reads low, and a cached figure stays: the first runs each probe again and the
# best is kept (seen: a 2-thread figure cached while the test suite's other worker ran read 37 GFLOPS, 1 thread 86)
PEAK_PROBES = 3


@dataclass
class FlopsCount:
    per_token: float | None  # model FLOPs per real token of a training step (None: not counted, see why)
    why_not: str | None = None
    attention_context: float = 0.0  # positions a token attends to, on average over the data


def attention_context(lengths: np.ndarray) -> float:
    """Positions a token attends to, averaged over the tokens of rows of these lengths (causal, per sequence)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return float((lengths * (lengths + 1) / 2).sum() / lengths.sum()) if lengths.size and lengths.sum() else 0.0


def count_flops(config, frozen: int, trained: int, lengths: np.ndarray, head_skipped: float = 0.0) -> FlopsCount:
    """`head_skipped`: FLOPs per real token the output head does not do, where the chunked loss multiplies only
    the positions with a target by it (head_flops_skipped)."""
    if getattr(config, "is_encoder_decoder", False):
        return FlopsCount(None, "not counted for encoder-decoder models (their tokens meet different weights)")
    experts = max(getattr(config, name, None) or 0 for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    if experts > 1:
        return FlopsCount(None, "not counted for mixture-of-experts models (a token meets only some experts)")
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not (layers and heads and width):
        return FlopsCount(None, "not counted: the model's config names no layers, heads or hidden size")
    head_dim = getattr(config, "head_dim", None) or width // heads
    context = attention_context(lengths)
    weights = 4 * frozen + 6 * trained - head_skipped
    attention = 3 * 4 * layers * heads * head_dim * context
    return FlopsCount(float(weights + attention), None, round(context, 1))


def head_flops_skipped(head_weights: tuple[int, bool], real_tokens: int | None, target_tokens: int | None) -> float:
    """Per real token: the head's FLOPs (6 per weight trained, 4 frozen) for the share of positions without a
    target, which the chunked loss never multiplies by it."""
    weights, head_trained = head_weights
    if not weights or not real_tokens or target_tokens is None:
        return 0.0
    return (6 if head_trained else 4) * weights * max(0.0, 1 - target_tokens / real_tokens)


@dataclass
class Peak:
    flops: float | None  # the run's peak per second: every GPU's, or every host's CPU
    source: str  # where the figure comes from, in words


def gpu_table_peak(name: str) -> float | None:
    for known, tflops in GPU_PEAK_TFLOPS:
        if known.lower() in name.lower():
            return tflops * 1e12
    return None


def run_peak(precision: str, peak_tflops: float | None, world_size: int, ranks_per_host: int) -> Peak:
    """The peak of the devices the run trains on, at its precision ("no", "bf16", "fp16"). A GPU is a device
    per rank; on CPUs the ranks of a host share its cores, so a host is the device (see the module's text)."""
    import torch

    cuda = torch.cuda.is_available()
    devices = world_size if cuda else max(1, world_size // max(1, ranks_per_host))
    unit = "GPU" if cuda else "CPU"
    times = f"{devices} × " if devices > 1 else ""
    if peak_tflops:
        return Peak(peak_tflops * 1e12 * devices, f"{times}{peak_tflops:g} TFLOPS per {unit} (peak_tflops)")
    dtype = {"no": "fp32"}.get(precision, precision)
    if cuda:
        name = torch.cuda.get_device_name(0)
        table = gpu_table_peak(name) if precision in ("bf16", "fp16") else None
        if table:
            return Peak(table * devices, f"{times}{table / 1e12:g} TFLOPS ({name}, dense {dtype}, data sheet)")
    threads = min(_cores(), torch.get_num_threads() * max(1, ranks_per_host))
    flops, where = measured_peak(precision, threads)
    article = "an" if dtype.startswith("f") else "a"  # (an fp32, a bf16)
    return Peak(flops * devices, f"{times}{flops / 1e9:,.0f} GFLOPS ({article} {dtype} matmul measured on {where})")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def measured_peak(precision: str, threads: int = 1) -> tuple[float, str]:
    """The best of PROBE_REPEATS square matmuls at the precision's dtype: on the GPU, or on `threads` threads
    of this CPU whatever this process's own thread count. Cached; the first PEAK_PROBES runs each measure again
    and keep the best, and a CPU figure below the one for fewer threads (measured while other work ran) is measured
    again. Ranks starting together take turns (a lock), so each reads the figure the first one wrote."""
    import fcntl

    import torch

    cuda = torch.cuda.is_available()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)

    def key_for(count: int) -> str:
        where = torch.cuda.get_device_name(0) if cuda else f"{_cpu_name()}, {count} thread{'s' if count != 1 else ''}"
        return f"{where} | {str(dtype).removeprefix('torch.')} | torch {torch.__version__}"

    key, where = key_for(threads), key_for(threads).split(" | ")[0]
    cache = Path(os.environ[PEAK_CACHE_ENV]) if os.environ.get(PEAK_CACHE_ENV) else cache_root() / PEAK_CACHE
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_suffix(".lock"), "a")
    except OSError:  # a read-only home: measure, and measure again next time
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read_cache(cache)
        flops, probes = _cached(known.get(key))
        fewer = [_cached(known.get(key_for(count)))[0] or 0.0 for count in range(1, threads)] if not cuda else []
        # the ranks of one launch take the figure the first of them measured: their plans must agree
        launch = _launch_id()
        same_launch = launch is not None and isinstance(known.get(key), dict) and known[key].get("launch") == launch
        if flops is None or not same_launch and (probes < PEAK_PROBES or any(figure > flops for figure in fewer)):
            flops = max(flops or 0.0, _probe("cuda" if cuda else "cpu", dtype, threads))
            known[key] = {"flops": flops, "probes": probes + 1, "launch": launch}
            if lock is not None:
                _write_cache(cache, known)
        return float(flops), where
    finally:
        if lock is not None:
            lock.close()  # (releases the lock)


def _probe(device: str, dtype, threads: int) -> float:
    import torch

    size = PROBE_SIZE[device]
    own = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)  # the cores the whole run uses on this host, not this rank's share
    try:
        if device == "cpu":  # a dtype this CPU has no fast kernel for (bf16 without AVX512-BF16/AMX: ~2 GFLOPS, 95 s
            size = min(size, _affordable_size(dtype))  # for one 2048² product) is measured on smaller squares
        a, b = _operands(size, dtype, device)
        best = float("inf")
        for _ in range(PROBE_REPEATS + 1):  # the first is a warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(own)
    return 2 * size**3 / best


def _operands(size: int, dtype, device: str):
    """Two random squares drawn from a generator of their own: the probe runs while the plan is built, after the
    run's seed is set, and a draw from torch's global generator would move every later one (the adapter's
    initial weights, dropout) in a run that probed against one that read the cache."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(size, size, generator=generator).to(device=device, dtype=dtype) for _ in range(2))


# below this rate at 256² a dtype has no fast kernel here (emulated bf16 on an AVX2 CPU: ~2 GFLOPS); above it the
# probe keeps its full size, whose 2048² product a fast kernel finishes in well under a second
SLOW_DTYPE_FLOPS = 10e9


def _affordable_size(dtype, seconds: float = PROBE_PRODUCT_SECONDS, small: int = 256) -> int:
    """The side of a square product that takes about `seconds` here, from one timed product of side `small`; the
    full probe size where the dtype is not clearly slow (a small product underrates a fast kernel's rate)."""
    import torch

    a, b = _operands(small, dtype, "cpu")
    torch.mm(a, b)
    start = time.perf_counter()
    torch.mm(a, b)
    rate = 2 * small**3 / max(time.perf_counter() - start, 1e-9)
    if rate >= SLOW_DTYPE_FLOPS:
        return PROBE_SIZE["cpu"]
    return max(small, int((rate * seconds / 2) ** (1 / 3)))


def _launch_id() -> str | None:
    """What the processes of one launch share (torchrun's run id, or the rendezvous address); None for a process
    started alone."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.environ["TORCHELASTIC_RUN_ID"] + "@" + os.environ.get("MASTER_ADDR", "") + ":" + \
            os.environ.get("MASTER_PORT", "")
    if os.environ.get("MASTER_PORT") and os.environ.get("WORLD_SIZE", "1") != "1":
        return os.environ.get("MASTER_ADDR", "") + ":" + os.environ["MASTER_PORT"]
    return None


def _cached(entry) -> tuple[float | None, int]:
    """(the figure, how many probes it is the best of) of a cache entry; a bare number (written before the figures
    were re-measured) counts as one probe."""
    if isinstance(entry, (int, float)):
        return float(entry), 1
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)):
        return float(entry["flops"]), int(entry.get("probes", 1))
    return None, 0


def _read_cache(cache) -> dict:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(cache, known: dict) -> None:
    """Replaced whole (a reader never sees half a file)."""
    import tempfile

    try:
        handle, temp = tempfile.mkstemp(dir=cache.parent, prefix=".peak-")
        with os.fdopen(handle, "w") as out:
            json.dump(known, out, indent=1)
        os.replace(temp, cache)
    except OSError:
        pass


def mfu(real_tokens_per_second: float | None, per_token: float | None, peak: float | None) -> float | None:
    """The share of the run's peak (every device's) that its real tokens per second (every rank's) make."""
    if not (real_tokens_per_second and per_token and peak):
        return None
    return real_tokens_per_second * per_token / peak


# ---- vision-language models: the image side, per image -----------------------------------------------------
# A vision-language model's language model is counted per token as above, image tokens included (they are rows'
# tokens). Its vision tower and projector are counted per image, from the positions they process, which the
# processor's arithmetic gives from the image's token count (the cache keeps it with each image reference):
#
# - the tower runs every position of the image (LLaVA's CLIP: every patch of its crop and the class position;
#   Qwen2-VL and Qwen3-VL: the patch grid before the 2×2 merge, merge² positions per image token; Idefics3:
#   scale_factor² positions per token, InternVL 1 / downsample_ratio², tile by tile; Gemma 3's SigLIP: every
#   patch before the pooling); its patch embedding (a convolution whose stride is its kernel) meets each patch
#   once, 2 FLOPs per weight;
# - the projector (LLaVA's multi_modal_projector, Qwen's merger and Qwen3-VL's DeepStack mergers, Idefics3's
#   connector) runs once per image token;
# - the tower's attention is bidirectional within an image (a tile for Idefics3): 4 FLOPs per layer, width and
#   position attended to, forward. Qwen2.5-VL's windowed blocks attend within windows of (window_size /
#   patch_size)² positions: counted as that many (or the image's, when smaller), an upper bound where a window
#   at an image's edge is cut short;
# - the backward runs only as far into the image side as a trained weight needs it: a weight's gradient (2 per
#   weight) where it is trained, its input's gradient (2 per weight, and twice the forward of a layer's attention)
#   where a trained weight comes before it. A frozen tower and projector (`freeze_mm_modules`, or LoRA on the
#   language model only) cost their forward alone; LLaVA's layers after `vision_feature_layer` run forward only.
# (Qwen3-VL's DeepStack mergers: per image token too, each over a middle layer's merged patches; GLM-4V's tower
# counts as Qwen2-VL's, its 2×2 downsampling convolution and merger per image token)
# (Gemma 4: every patch of its image processor's budget, max_soft_tokens × pooling², padding included; its
# pooler's matmul averages them into max_soft_tokens; its embed_vision projects the image's own soft tokens)
# (every family's projector_parts: what runs once per image token, whichever family a module is found in)
PROJECTOR_PARTS = tuple(dict.fromkeys(part for family in VISION_FAMILIES.values() for part in family.projector_parts))


@dataclass(frozen=True)
class VisionWeights:
    """The image side of a vision-language model, as the plan counts it (vision_weights)."""

    family: str
    # every matmul of the image side in forward order: (stage, tower layer or -1, weights, trained); stage is
    # "patch" (the patch embedding), "layer", "other" (the tower's matmuls outside its layers, per position),
    # "pooling" (SigLIP's pooling head: one position) or "projector"
    matmuls: tuple[tuple[str, int, int, bool], ...]
    layers: int
    width: int  # the tower's attention width (heads × head size)
    gradient_layers: int  # the tower layers the loss's gradient can reach (LLaVA: up to vision_feature_layer)
    in_text_count: tuple[int, int]  # what model_facts.count_matmul_weights counted of these (frozen, trained): the text
    # model's weights per token are the rest
    # positions the tower runs per image: fixed (per image, `cls` of them without a patch) or per image token (and
    # `cls` a tile of `tile_tokens` image tokens: InternVL's class position)
    fixed_positions: int = 0
    cls: int = 0
    positions_per_token: int = 0
    tile_tokens: int = 0
    context: int = 0  # positions one attends to within a tile (Idefics3); 0: the whole image
    window: int = 0  # Qwen2.5-VL: positions of a window in its windowed layers
    full_layers: tuple[int, ...] = ()  # Qwen2.5-VL: the layers that attend over the whole image
    # Gemma 4: the soft tokens its pooler averages every position into, by a matmul (a one-hot matrix of them ×
    # the positions, 2 FLOPs per pooled token, position and width; its input gradient where the tower trains)
    pooled: int = 0
    why_not: str | None = None  # where the image side is not counted

    def weights(self, stage: str | None = None) -> tuple[int, int]:
        """(frozen, trained) weights of a stage, or of the whole image side."""
        chosen = [(weights, trained) for where, _, weights, trained in self.matmuls if stage in (None, where)]
        return (sum(w for w, t in chosen if not t), sum(w for w, t in chosen if t))


def vision_weights(model, config, family, image_processor=None) -> VisionWeights:
    """The image side's matmuls in forward order (the modules' order), from the model as it is built (adapter and
    freezing included: the meta-device copy of model_facts.model_facts). `image_processor`: the run's, where
    the positions the tower runs are its setting (Gemma 4's max_soft_tokens)."""
    import torch

    def as_counted(module) -> bool:  # model_facts.count_matmul_weights's rule
        return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"

    tower_parts = [part for part in family.vision_modules if part not in PROJECTOR_PARTS]
    modules = dict(model.named_modules())
    layer_lists = [(name, module) for name, module in modules.items()
                   if isinstance(module, torch.nn.ModuleList) and len(module)
                   and any(part in name.split(".") for part in tower_parts)
                   and not any(part in name.split(".") for part in PROJECTOR_PARTS)]
    # the tower's layers: its largest list of blocks (CLIP's encoder.layers, Qwen's blocks)
    layers_name, layer_list = max(layer_lists, key=lambda item: sum(p.numel() for p in item[1].parameters()),
                                  default=(None, ()))
    matmuls, counted = [], [0, 0]
    for name, module in modules.items():
        parts = name.split(".")
        if not any(part in parts for part in family.vision_modules):
            continue
        conv = isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))
        in_projector = any(part in parts for part in PROJECTOR_PARTS)
        if as_counted(module) or conv:
            own = [module.weight]
        elif in_projector and not isinstance(module, torch.nn.Embedding):  # (Gemma 3's projection is a bare matrix)
            own = [p for p in module.parameters(recurse=False) if p.ndim >= 2]
        else:
            continue
        for weight in own:
            if as_counted(module):
                counted[int(weight.requires_grad)] += weight.numel()
            if in_projector:
                stage, layer = "projector", -1
            elif conv or "patch_embedder" in parts:  # (Gemma 4's patch embedding is a Linear over each patch)
                stage, layer = "patch", -1
            elif layers_name is not None and name.startswith(layers_name + "."):
                stage, layer = "layer", int(name[len(layers_name) + 1:].split(".")[0])
            elif "head" in parts:  # SigLIP's attention-pooling head: one probe position per image
                stage, layer = "pooling", -1
            else:
                stage, layer = "other", -1
            matmuls.append((stage, layer, weight.numel(), weight.requires_grad))
    order = {"patch": 0, "layer": 1, "other": 2, "pooling": 2, "projector": 3}  # (a stage's modules may be listed out of order)
    matmuls.sort(key=lambda item: order[item[0]])  # (stable: the modules' order within a stage)
    vision = config.vision_config
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    return VisionWeights(family.name, tuple(matmuls), len(layer_list), width,
                         gradient_layers=_gradient_layers(config, len(layer_list)), in_text_count=tuple(counted),
                         **_vision_shape(config, family, len(layer_list), image_processor))


def _vision_shape(config, family, layers: int, image_processor=None) -> dict:
    """How many positions the tower runs per image, and how far each attends (see the notes above): the family's
    own tower shape (its record in tuneloop/vision_families/)."""
    if family.tower_shape is None:
        return {"why_not": f"not counted for {family.name}'s vision tower yet"}
    return family.tower_shape(config, layers, image_processor)


def _gradient_layers(config, layers: int) -> int:
    """LLaVA reads the hidden states of `vision_feature_layer` (-2: the layer before the last): the layers after it
    run forward, and no gradient reaches them."""
    chosen = getattr(config, "vision_feature_layer", None)
    if chosen is None:
        return layers
    indexes = [chosen] if isinstance(chosen, int) else list(chosen)
    # hidden_states[0] is the embeddings' output, hidden_states[k] the k-th layer's
    return max(index if index >= 0 else layers + 1 + index for index in indexes)


@dataclass
class VisionFlops:
    total: float  # FLOPs of the image side over the images counted (one pass over the training rows)
    images: int
    positions: int  # tower positions over those images


def count_vision_flops(vision: VisionWeights, image_tokens) -> VisionFlops:
    """The image side's FLOPs (forward and backward) for images of these token counts (see the notes above)."""
    tokens, repeats = np.unique(np.asarray(image_tokens, dtype=np.int64), return_counts=True)
    total = positions_all = 0.0
    for count, times in zip(tokens.tolist(), repeats.tolist()):
        flops, positions = image_flops(vision, count)
        total += flops * times
        positions_all += positions * times
    return VisionFlops(float(total), int(repeats.sum()), int(positions_all))


def image_positions(vision: VisionWeights, tokens: int) -> tuple[int, int]:
    """(tower positions, of them class positions without a patch) of an image of `tokens` image tokens."""
    if vision.fixed_positions:
        return vision.fixed_positions, vision.cls
    classes = tokens // vision.tile_tokens * vision.cls if vision.tile_tokens else 0  # (InternVL: one a tile)
    return tokens * vision.positions_per_token + classes, classes


def image_flops(vision: VisionWeights, tokens: int) -> tuple[float, int]:
    """(FLOPs, tower positions) of one image of `tokens` image tokens. A matmul's input gradient is counted where
    a trained weight comes before it; a layer's attention backward where a trained weight comes before or in it;
    a weight's gradient where it is trained and the gradient reaches its layer."""
    positions, classes = image_positions(vision, tokens)
    at = {"patch": positions - classes, "layer": positions, "other": positions, "pooling": 1, "projector": tokens}
    flops, trained_before = 0.0, False
    for layer in range(vision.layers):  # the attention, per layer
        attends = (min(vision.context, positions) if vision.context else positions) if (
            not vision.window or layer in vision.full_layers) else min(vision.window, positions)
        before = any(trained for stage, index, _, trained in vision.matmuls
                     if stage == "patch" or stage == "layer" and index <= layer)
        backward = before and layer < vision.gradient_layers
        flops += positions * 4 * vision.width * attends * (3 if backward else 1)
    tower_trained = any(trained for stage, index, _, trained in vision.matmuls
                        if stage in ("patch", "other") or stage == "layer" and index < vision.gradient_layers)
    flops += vision.pooled * positions * 2 * vision.width * (2 if tower_trained else 1)  # (Gemma 4's pooler)
    for stage, layer, weights, trained in vision.matmuls:
        # (the pooling head's output is never read by these families: no gradient reaches it)
        reached = stage not in ("layer", "pooling") or layer < vision.gradient_layers
        flops += at[stage] * weights * (2 + (2 if trained and reached else 0)
                                        + (2 if trained_before and reached and stage != "patch" else 0))
        trained_before = trained_before or (trained and reached)
    return flops, positions


def row_image_tokens(store, block: int = 50_000) -> list[list[int]]:
    """Each row's images' token counts, in row order (data/token_store.py keeps each row's [reference, tokens]
    pairs as JSON text), read in blocks of rows."""
    from tuneloop.data.token_store import IMAGES

    if store is None or not getattr(store, "has_images", False):
        return []
    offsets, rows = store.image_offsets, []
    with open(store.folder / IMAGES, "rb") as handle:
        for start in range(0, len(store), block):
            stop = min(start + block, len(store))
            handle.seek(int(offsets[start]))
            text = handle.read(int(offsets[stop]) - int(offsets[start]))
            for first, last in zip(offsets[start:stop], offsets[start + 1:stop + 1]):
                begin = int(first - offsets[start])
                rows.append([count for _, count in json.loads(text[begin:begin + int(last - first)])])
    return rows


def largest_micro_batch_tower_positions(vision: VisionWeights, per_row: list[list[int]], epochs) -> int:
    """The most positions the vision tower runs for one micro-batch over the run's epochs, each epoch's per-rank
    micro-batches as the plan deals them (a micro-batch is a list of rows, each a list of the store's rows: one,
    or a packed row's)."""
    largest = 0
    for batches in (batches for per_rank in epochs for batches in per_rank):
        for micro in batches:
            rows = [row for entry in micro for row in (entry if isinstance(entry, (list, tuple)) else [entry])]
            positions = sum(image_positions(vision, tokens)[0] for row in rows for tokens in per_row[row])
            largest = max(largest, positions)
    return largest


def image_token_counts(store, block: int = 50_000) -> np.ndarray:
    """Every image's token count over a vision-language store's rows, in row order (row_image_tokens)."""
    return np.asarray([count for row in row_image_tokens(store, block) for count in row], dtype=np.int64)


def with_images(text: FlopsCount, vision: VisionWeights, image_tokens: np.ndarray,
                real_tokens: float) -> tuple[FlopsCount, dict]:
    """The text model's count per token (every token, image tokens too) and the image side's, per real token
    over the training rows (`real_tokens`: theirs), and the split in words for the plan."""
    if text.per_token is None:
        return text, {}
    if vision.why_not:
        return FlopsCount(None, vision.why_not), {}
    images = count_vision_flops(vision, image_tokens)
    text_total = text.per_token * real_tokens
    share = images.total / (text_total + images.total) if text_total + images.total else 0.0
    split = {"share": share, "images": images.images, "tower_positions": images.positions,
             "flops_per_image": images.total / images.images if images.images else 0.0,
             "words": f"vision tower and projector {share:.1%} of a step's FLOPs ({images.images:,} images, "
                      f"{images.positions / max(images.images, 1):,.0f} tower positions per image on average)"}
    return FlopsCount(text.per_token + images.total / real_tokens if real_tokens else text.per_token, None,
                      text.attention_context), split
