"""The `infer`, `eval`, `merge-lora`, `export`, `quantize` and `push` (use/hub.py) subcommands. Light at import: torch,
transformers, peft and huggingface_hub are imported inside the handlers, so `tuneloop --help` stays instant."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tuneloop.arguments import at_least_one, not_negative, probability, seed
from tuneloop.errors import UserError


def add_use_commands(commands) -> None:
    """Registers the six commands on the CLI's subparsers object."""
    from tuneloop.use.hub import add_push_command
    from tuneloop.use.vllm_serve import add_vllm_serve_command

    _add_infer(commands)
    _add_eval(commands)
    _add_merge(commands)
    _add_export(commands)
    _add_quantize(commands)
    add_push_command(commands)
    add_vllm_serve_command(commands)


def _add_config_arguments(parser: argparse.ArgumentParser, optional: bool) -> None:
    parser.add_argument("config", nargs="?" if optional else None, help="the run's YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (value parsed as YAML); repeatable")


def _add_infer(commands) -> None:
    infer = commands.add_parser("infer", help="complete prompts with a trained model (jsonl on stdout), or chat")
    _add_config_arguments(infer, optional=True)
    infer.add_argument("--model", metavar="DIR",
                       help="a model folder (config.json and weights) or a LoRA adapter folder, instead of CONFIG")
    infer.add_argument("--base", metavar="DIR", help="an adapter's base model, instead of the one it names")
    infer.add_argument("--prompts", metavar="FILE", help="prompts: .jsonl rows with `prompt` or `messages`, else "
                       "one prompt a line (default: stdin)")
    infer.add_argument("--max-new-tokens", type=at_least_one, default=128, metavar="N",
                       help="the longest completion (128)")
    infer.add_argument("--temperature", type=not_negative, default=0.0, metavar="T", help="0 (the default): greedy")
    infer.add_argument("--top-p", type=probability, default=1.0, metavar="P", help="nucleus sampling (1.0: off)")
    infer.add_argument("--seed", type=seed, default=None, metavar="S", help="seed for sampling")
    infer.add_argument("--batch-size", type=at_least_one, default=8, metavar="B",
                       help="prompts generated together (8); halved on out-of-memory")
    infer.add_argument("--raw", action="store_true",
                       help="plain prompts as raw text, without the tokenizer's chat template")
    infer.add_argument("--chat", action="store_true", help="a conversation: one user turn a line on stdin")
    infer.add_argument("--image", action="append", default=[], metavar="FILE",
                       help="an image for the prompt (a vision-language model; one prompt); repeatable, in order. "
                            "jsonl prompts hold theirs as parts: {\"type\": \"image\", \"path\": ...}")
    infer.set_defaults(handler=command_infer)


def _add_eval(commands) -> None:
    evaluate = commands.add_parser("eval", help="the config's eval set through the trained model (or --model)")
    _add_config_arguments(evaluate, optional=False)
    evaluate.add_argument("--model", metavar="DIR",
                          help="evaluate this model folder or adapter instead of output_dir (the base, say)")
    evaluate.add_argument("--output", metavar="FILE", help="also write the result to FILE as JSON")
    evaluate.set_defaults(handler=command_eval)


def _add_merge(commands) -> None:
    from tuneloop.use.merge import MERGE_DTYPES  # (light: merge.py imports torch inside its functions)

    merge = commands.add_parser("merge-lora", help="fold a LoRA adapter into its base: a plain model folder")
    _add_config_arguments(merge, optional=True)
    merge.add_argument("--adapter", metavar="DIR", help="the adapter folder, instead of CONFIG's output_dir")
    merge.add_argument("--base", metavar="DIR", help="the base model, instead of the one the adapter names")
    merge.add_argument("--output", metavar="DIR", help="where the merged model goes (default: OUTPUT_DIR/merged, "
                       "or ADAPTER/merged); it must not exist or be empty")
    merge.add_argument("--dtype", choices=MERGE_DTYPES, default="auto",
                       help="the merged weights' dtype (auto, the default: the base's own; a QLoRA run's base is "
                            "dequantized to it)")
    merge.set_defaults(handler=command_merge)


def _add_export(commands) -> None:
    from tuneloop.use.exporters import EXPORTERS  # (light: each writer is imported when it runs)

    formats = EXPORTERS.names()
    export = commands.add_parser("export", help="the trained model (a LoRA run merged first) as " + "; or ".join(
        f"{EXPORTERS[name].summary} (--format {name})" for name in formats))
    _add_config_arguments(export, optional=True)
    export.add_argument("--model", metavar="DIR", help="a model folder or a LoRA adapter folder, instead of CONFIG")
    export.add_argument("--base", metavar="DIR", help="an adapter's base model, instead of the one it names")
    export.add_argument("--format", choices=formats, default=formats[0],
                        help="; ".join(f"{name}: {EXPORTERS[name].summary}" + (" (the default)" if name == formats[0]
                                                                              else "") for name in formats))
    # (no argparse choices: a name the format does not write is said by the command, with how to get it)
    export.add_argument("--quant", default=None,
                        help="the weights' type; " + "; ".join(f"{name}: {EXPORTERS[name].quant_help()}"
                                                             for name in formats))
    suffixes = ", ".join(f"{EXPORTERS[name].suffix} ({name})" for name in formats)
    export.add_argument("--output", metavar="FILE", help=f"the exported file (default: OUTPUT_DIR/model-QUANT.SUFFIX, "
                        f"or DIR/model-QUANT.SUFFIX; the format's SUFFIX: {suffixes})")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing output that tuneloop exported (never another program's file)")
    export.set_defaults(handler=command_export)


def _add_quantize(commands) -> None:
    quantize = commands.add_parser("quantize", help="a QAT run's model quantized by torchao as its `qat:` block says "
                                   "(int4/int8 weights): a folder from_pretrained reloads")
    _add_config_arguments(quantize, optional=True)
    quantize.add_argument("--model", metavar="DIR", help="a model folder a QAT run saved (its run_config.yml beside "
                          "it says how), instead of CONFIG")
    quantize.add_argument("--output", metavar="DIR", help="where the quantized model goes (default: "
                          "OUTPUT_DIR/quantized, or DIR/quantized); it must not exist or be empty")
    quantize.set_defaults(handler=command_quantize)


def load_config(args):
    from tuneloop.console import load_config_saying_warnings

    return load_config_saying_warnings(args)


def _one_source(args, command: str, flag: str) -> None:
    if (args.config is None) == (getattr(args, flag.strip("-")) is None):
        raise UserError(f"{command}: give CONFIG or {flag} DIR (one of them)")


def _source_folder(args, command: str, flag: str, find=None, while_training: str | None = None):
    """(the model folder CONFIG's output_dir or `flag` names, the config or None): an adapter sits on --base, else
    on the config's base_model, else on the base its adapter_config.json names. `find(path, what, base)`: how
    the folder is read (default: a full model or an adapter). `while_training`: why the command refuses a folder a
    run is training in, if it does."""
    from tuneloop.use.folders import find_model_folder

    _one_source(args, command, flag)
    cfg = load_config(args) if args.config is not None else None
    if while_training is not None:
        _refuse_a_training_run(cfg.output_dir if cfg is not None else getattr(args, flag.strip("-")), command,
                               while_training)
    if cfg is not None:
        if find is not None:
            return find(cfg.output_dir, "output_dir", args.base or cfg.base_model), cfg
        return find_model_folder(cfg.output_dir, f"{command}: output_dir", base=args.base or cfg.base_model,
                                 no_model_hint="; train first (`tuneloop train CONFIG`), or give --model DIR"), cfg
    given = getattr(args, flag.strip("-"))
    if find is not None:
        return find(given, flag, args.base), None
    return find_model_folder(given, f"{command}: {flag}", base=args.base), None


def _refuse_a_training_run(folder, command: str, why: str) -> None:
    """A run training in the folder holds its lock (run_files.OutputDirLock), from its plan to its last save."""
    from tuneloop.run_files import training_in

    path = Path(folder).expanduser()
    who = training_in(path)
    if who is not None:
        raise UserError(f"{command}: a run is training in {path} ({who}); {why}: wait for it to end, then "
                        f"{command} again")


def _trusts_remote_code(cfg) -> bool:
    return bool(cfg is not None and cfg.trust_remote_code)


# ---- infer ---------------------------------------------------------------------------------------

def command_infer(args) -> int:
    from tuneloop.host.hardware import quiet_deepspeed_on_cpu
    from tuneloop.use.generate import GenerationSettings, chat, generate_all, print_rows, read_prompt_rows

    quiet_deepspeed_on_cpu()
    _one_source(args, "infer", "--model")  # said before the others
    if args.chat and args.prompts:
        raise UserError("infer: --chat reads the conversation from stdin; drop --prompts (or --chat)")
    if args.image and (args.chat or args.raw):
        flag = "--chat" if args.chat else "--raw"
        raise UserError(f"infer: --image goes into one prompt rendered by the chat template; drop {flag} (or --image)")
    settings = GenerationSettings(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.batch_size,
                                  use_template=not args.raw)
    settings.check()
    rows = None if args.chat else read_prompt_rows(args.prompts)  # a bad file is said before the model loads
    if args.image:
        rows = _with_image_flags(rows, args.image)
    if args.chat:
        model, tokenizer, _ = load_for_inference(args)
        chat(model, tokenizer, settings)
        return 0
    model, tokenizer, vision = load_for_inference(args, images_in=_first_with_images(rows, args.image))
    prompts = [prompt for _, prompt in rows]
    print_rows(prompts, generate_all(model, tokenizer, prompts, settings, vision=vision,
                                     wheres=[where for where, _ in rows]))
    return 0


def _with_image_flags(rows, paths: list[str]):
    """`--image FILE ...`: the images of the one prompt, read now (a bad file is said before the model loads)."""
    from tuneloop.use.vision import image_part, with_images

    if len(rows) != 1:
        raise UserError(f"infer: --image goes with a single prompt, and {len(rows)} were given; give one prompt, or "
                        "put each row's images in its messages ({\"type\": \"image\", \"path\": ...} parts)")
    parts = [image_part({"type": "image", "path": path}, f"--image {path}", Path.cwd()) for path in paths]
    where, prompt = rows[0]
    return [(where, with_images(prompt, parts))]


def _first_with_images(rows, image_flags: list[str]) -> str | None:
    """What to name when a text-only model is given images: the flag, or the first row that holds one."""
    from tuneloop.use.vision import prompt_has_images

    if image_flags:
        return f"--image {image_flags[0]}"
    return next((where for where, prompt in rows if prompt_has_images(prompt)), None)


def load_for_inference(args, images_in: str | None = None):
    """(model, tokenizer, VisionPrompts or None): CONFIG's output_dir (an adapter there sits on the config's
    base_model) or --model. `images_in`: the flag or row with an image, refused for a text-only model before it
    loads."""
    from tuneloop.use.folders import load_model_from, load_tokenizer_of
    from tuneloop.use.generate import prepare_for_generation
    from tuneloop.data.images import is_vision_config
    from tuneloop.use.vision import VisionPrompts, folder_config, folder_image_inputs

    folder, cfg = _source_folder(args, "infer", "--model")
    trust_remote_code = _trusts_remote_code(cfg)
    config = folder_config(folder, trust_remote_code)
    vision_model = config is not None and is_vision_config(config)
    if images_in is not None and not vision_model:
        raise UserError(f"infer: {images_in}: an image, and {folder.base if folder.is_adapter else folder.path} is a "
                        "text-only model (its config has no vision_config); drop the image, or give a "
                        "vision-language model's folder")
    tokenizer = load_tokenizer_of(folder)
    # (the processor before the model: a folder without one is said before the weights load)
    vision = None
    if vision_model:
        # the images resized as the run resized them (axolotl's image_size is no processor setting: it is not in the
        # saved processor, but in the run's config)
        try:
            run = _run_config_of(cfg, folder)
        except UserError as error:  # (a run_config.yml an older tuneloop wrote: the model still answers)
            print(f"warning: infer: the run's config does not read ({error}); images go to the processor as they "
                  "are, not resized as the run's image_size would", file=sys.stderr, flush=True)
            run = None
        inputs = folder_image_inputs(folder, config, tokenizer, trust_remote_code,
                                     image_size=run.image_size if run is not None else None,
                                     resample=(run.image_resize_algorithm if run is not None else None) or "bilinear")
        vision = VisionPrompts(inputs, tokenizer)
    quantized = _quantized_base_of_run(cfg, folder) if folder.is_adapter else None
    if quantized is not None:  # a QLoRA / 8-bit run's adapter on its base quantized as it was trained (as eval does)
        from tuneloop.adapters import keep_4bit_layout

        model = load_model_from(folder, quantized.dtype, trust_remote_code=trust_remote_code,
                                vocabulary=len(tokenizer), quantization=quantized.bnb_config)
        quantized.quantize_experts(model)
        keep_4bit_layout(model)
    else:
        model = load_model_from(folder, "auto", trust_remote_code=trust_remote_code, vocabulary=len(tokenizer))
    return prepare_for_generation(model), tokenizer, vision


# ---- eval ----------------------------------------------------------------------------------------

def command_eval(args) -> int:
    from tuneloop.use.evaluate_model import evaluate_model

    result = evaluate_model(load_config(args), args.model)
    text = json.dumps(result)
    if args.output:
        _write(Path(args.output), json.dumps(result, indent=2) + "\n", "eval: --output")
    print(text, flush=True)
    return 0


def _write(path: Path, text: str, flag: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot write it ({error.strerror or error})") from None


# ---- merge-lora ----------------------------------------------------------------------------------

def command_merge(args) -> int:
    from tuneloop.host.hardware import quiet_deepspeed_on_cpu
    from tuneloop.run_files import MERGED
    from tuneloop.use.merge import adapter_folder, merge_lora
    from tuneloop.use.vision import processor_note

    quiet_deepspeed_on_cpu()
    folder, cfg = _source_folder(args, "merge-lora", "--adapter", find=adapter_folder)
    output = Path(args.output).expanduser() if args.output else folder.path / MERGED
    quantized = _quantized_base_of_run(cfg, folder)
    merged = merge_lora(folder, output, _trusts_remote_code(cfg), quantized, dtype=args.dtype)
    dequantized = " (the adapter merged into its base dequantized, as it was trained)" if quantized is not None else ""
    print(f"merged model saved to {merged}{processor_note(merged)}{dequantized}", flush=True)
    return 0


def _run_config_of(cfg, folder):
    """The config the folder's run trained with: CONFIG, else the run_config.yml a tuneloop run leaves in its
    output_dir (beside the model or adapter, or above a checkpoint's); None for a folder no tuneloop run left."""
    if cfg is not None:
        return cfg
    from tuneloop.config import load_config as load_yaml
    from tuneloop.run_files import RUN_CONFIG

    found = [folder.path / RUN_CONFIG, folder.path.parent / RUN_CONFIG]
    run_config = next((path for path in found if path.is_file()), None)
    return load_yaml(str(run_config)) if run_config is not None else None


def _quantized_base_of_run(cfg, folder):
    """(the bitsandbytes config, the weights' dtype) the adapter's run loaded its base with (CONFIG's, or its
    run_config.yml's); None for a LoRA on full-precision weights."""
    from tuneloop.model.load import quantized_base

    cfg = _run_config_of(cfg, folder)
    return quantized_base(cfg) if cfg is not None else None


# ---- export --------------------------------------------------------------------------------------

def command_export(args) -> int:
    from tuneloop.host.hardware import quiet_deepspeed_on_cpu
    from tuneloop.use.exporters import EXPORTERS
    from tuneloop.use.folders import check_base_reachable

    quiet_deepspeed_on_cpu()
    exporter = EXPORTERS[args.format]
    quant = args.quant or exporter.default_quant
    if quant not in exporter.quantizations and quant.lower() in exporter.quantizations:
        quant = quant.lower()  # (Q8_0, as llama.cpp spells it)
    folder, cfg = _source_folder(args, "export", "--model",
                                 while_training="the model there is the one it replaces, or none yet")
    if folder.is_adapter:
        check_base_reachable(folder)  # (a base folder that moved: said, before the hub's name rules are)
    if args.output:
        output = Path(args.output).expanduser()
        if output.suffix != exporter.suffix:
            raise UserError(f"export: --output {output} does not end in {exporter.suffix}; {exporter.readers} look "
                            "for that")
    if quant not in exporter.quantizations:
        def output_for(other: str) -> Path:
            return output if args.output else folder.path / f"model-{other}{exporter.suffix}"

        raise UserError("export: " + (exporter.elsewhere(quant, output_for) or (
            f"--quant {quant} is not one of --format {args.format}'s: {exporter.quantizations.choices()}")))
    if not args.output:
        output = folder.path / f"model-{quant}{exporter.suffix}"
    trust_remote_code = _trusts_remote_code(cfg)
    done = exporter.write(folder, output, quant, overwrite=args.overwrite, trust_remote_code=trust_remote_code,
                          base_quantization=_quantized_base_of_run(cfg, folder) if folder.is_adapter else None)
    for line in exporter.hints(done):
        print(line, flush=True)
    return 0


# ---- quantize ------------------------------------------------------------------------------------

def command_quantize(args) -> int:
    from tuneloop.host.hardware import quiet_deepspeed_on_cpu
    from tuneloop.run_files import QUANTIZED
    from tuneloop.use.quantize import qat_settings, quantize_folder, words

    quiet_deepspeed_on_cpu()
    args.base = None  # (a QAT run saves a whole model: there is no adapter base to name)
    folder, cfg = _source_folder(args, "quantize", "--model")
    settings = qat_settings(cfg, folder)  # as the run recorded it trained
    output = Path(args.output).expanduser() if args.output else folder.path / QUANTIZED
    done = quantize_folder(folder, settings, output, _trusts_remote_code(cfg))
    print(f"quantized model ({words(settings)}) saved to {done}; from_pretrained loads it with torchao installed",
          flush=True)
    return 0
