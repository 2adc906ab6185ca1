"""torch.compile for training (axolotl's `torch_compile`, `torch_compile_mode`, `torch_compile_backend` and
`torch_compile_options`).

What is compiled is the part of the model the step runs: its decoder when the chunked loss meets the output
projection itself (train/objectives.py), the whole model otherwise. It is compiled in place
(`nn.Module.compile`), so parameter names, checkpoints and the saved folder are those of the eager model.

Shapes: a padded batch's width changes from step to step, and each new width would be a new graph. Widths are
rounded up to multiples of 64 under compile (data/collate.py), so few shapes recur; after the second one torch
marks the width dynamic, compiles once more, and then reuses that graph. The first step pays for compiling:
the loop times it apart from the steps that follow (loop.py), and the plan says so.

`torch_compile: auto` (the default) compiles where the plan predicts the run repays it (plan/compile_choice.py);
every finished run records its first step and its pace for that decision (run.py). Compiled artifacts are kept
in tuneloop's cache (`keep_compiled_artifacts`).

Evals run the model eagerly (`torch.compiler.set_stance("force_eager")`): without gradients the compiled
model would compile a second graph, and eval batches bring their own widths. On the quickstart that eval
compiling took longer than the 14 training steps themselves.
"""

from __future__ import annotations

import contextlib

from tuneloop.errors import UserError


def compile_for_training(cfg, resolved, model) -> str:
    """Compiles the step's part of `model` in place; returns what was compiled, in words."""
    from tuneloop.kernels.output_head import loss_meets_head_in_chunks, output_head

    if resolved.compile_auto:  # chosen for speed alone: a part torch cannot compile runs eagerly instead
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
    _set_inductor_options(cfg.torch_compile_options or {})
    options = {"backend": cfg.torch_compile_backend or "inductor"}
    if cfg.torch_compile_mode:
        options["mode"] = cfg.torch_compile_mode
    if loss_meets_head_in_chunks(cfg, model):
        decoder, _ = output_head(model)
        decoder.compile(**options)
        return f"the decoder ({type(decoder).__name__}), {options['backend']}"
    model.compile(**options)
    return f"the whole model ({type(model).__name__}), {options['backend']}"


def keep_compiled_artifacts() -> None:
    """torch's compile caches (inductor's graphs and kernels, AOTAutograd's) in tuneloop's cache instead of /tmp, so
    a rerun or a resume after a reboot compiles from them: the embedded model's first compiled step took 71 s
    cold and 12 s warm. Where the user set the variables, theirs stand. Set when a tuneloop process starts (cli.py):
    inductor writes its default into the environment the first time it reads it."""
    import os

    from tuneloop.cache import cache_root

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "compiled"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_root() / "compiled" / "triton"))


def eager_for_eval(compiled: bool):
    """The context evals run in: eager where the model was compiled for training."""
    import torch

    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def _set_inductor_options(flags: dict) -> None:
    """torch._inductor.config flags by name (a dotted name reaches a sub-section, e.g. `triton.cudagraphs`)."""
    if not flags:
        return
    import torch._inductor.config as inductor

    for name, value in flags.items():
        section, _, leaf = name.rpartition(".")
        holder = inductor
        for part in filter(None, section.split(".")):
            holder = getattr(holder, part, None)
        if holder is None or not hasattr(holder, leaf):
            raise UserError(f"config: `torch_compile_options: {name}` is not a torch._inductor.config flag of "
                            "this torch; remove it or check its name")
        setattr(holder, leaf, value)
