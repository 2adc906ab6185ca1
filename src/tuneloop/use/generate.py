"""`tuneloop infer`: completions for a file of prompts (jsonl out, in input order), or a chat at the terminal.

Prompts are generated in batches of similar length (left-padded, so every row's new tokens start at the same
column). An out-of-memory error halves the batch and retries it, down to one prompt at a time.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from tuneloop.data.mistral_chat import is_mistral_common
from tuneloop.errors import UserError

# Turn-ending tokens of common chat formats. A chat model ends its reply with one of them, which is often not
# the tokenizer's eos (a base model given a chatml template keeps <|endoftext|> as its eos, say).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eot|>", "<end_of_turn>", "<|end|>")
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"

Prompt = str | list  # plain text, or a chat: a list of {"role", "content"} messages


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    batch_size: int = 8
    use_template: bool = True  # the tokenizer's chat template, where it has one

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"infer: --max-new-tokens {self.max_new_tokens}: give 1 or more")
        if self.temperature < 0:
            raise UserError(f"infer: --temperature {self.temperature}: give 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise UserError(f"infer: --top-p {self.top_p}: give a value in (0, 1]")
        if self.batch_size < 1:
            raise UserError(f"infer: --batch-size {self.batch_size}: give 1 or more")


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


# ---- reading prompts -----------------------------------------------------------------------------

def read_prompts(path: str | None, stdin: Iterable[str] | None = None) -> list[Prompt]:
    """From `path` (.jsonl: one JSON object a line; else one prompt a line), or from stdin, where a line that
    starts with `{` is read as JSON. Blank lines are skipped."""
    return [prompt for _, prompt in read_prompt_rows(path, stdin)]


def read_prompt_rows(path: str | None, stdin: Iterable[str] | None = None) -> list[tuple[str, Prompt]]:
    """(where, prompt) of each prompt: `file:line`. An image part's path is relative to the file's folder (the
    working folder for stdin), and the image is read now."""
    from_stdin = path is None
    name = "<stdin>" if from_stdin else str(path)
    lines = (sys.stdin if stdin is None else stdin) if from_stdin else _file_lines(path)
    base_dir = Path.cwd() if from_stdin else Path(path).expanduser().resolve().parent
    all_json = not from_stdin and Path(path).suffix == ".jsonl"
    prompts = []
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        as_json = all_json or (from_stdin and line.lstrip().startswith("{"))
        where = f"{name}:{number}"
        prompts.append((where, json_prompt(line, where, base_dir) if as_json else line))
    if not prompts:
        raise UserError(f"infer: no prompts in {name}; give one a line (or jsonl rows with `prompt` or `messages`)")
    return prompts


def _file_lines(path: str) -> list[str]:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise UserError(f"infer: --prompts {path}: cannot read it ({reason})") from None


def json_prompt(line: str, where: str, base_dir: Path | None = None) -> Prompt:
    """A row's `prompt` (a string) or `messages` (a list of {"role", "content"}; content a string, or a list of
    parts {"type": "text", "text"} and {"type": "image", "path" | "url" | "base64" | "image"}, as training rows
    write them, each image read now)."""
    try:
        row = json.loads(line)
    except ValueError as error:
        raise UserError(f"infer: {where}: not a JSON object ({error})") from None
    if not isinstance(row, dict):
        raise UserError(f"infer: {where}: a row must be a JSON object with `prompt` or `messages`")
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    messages = row.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
            for m in messages):
        return [{**m, "content": _content(m["content"], where, base_dir or Path.cwd())} for m in messages]
    raise UserError(f"infer: {where}: a row needs `prompt` (a string) or `messages` (a non-empty list of "
                    "{\"role\": ..., \"content\": ...} with string values, or lists of text and image parts)")


def _content(content: str | list, where: str, base_dir: Path) -> str | list:
    if isinstance(content, str):
        return content
    from tuneloop.use.vision import image_part, is_image_part

    parts = []
    for part in content:
        if is_image_part(part):
            parts.append(image_part(part, where, base_dir))
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UserError(f"infer: {where}: a content part of type {kind!r}; a prompt takes parts of type 'text' "
                            "({\"type\": \"text\", \"text\": ...}) and 'image' ({\"type\": \"image\", \"path\": ...})")
    return parts


# ---- prompts to token ids ------------------------------------------------------------------------

def encodes_chats(tokenizer) -> bool:
    """A chat template, or mistral-common's own chat encoding (a run with `tokenizer_use_mistral_common`)."""
    return bool(tokenizer.chat_template) or is_mistral_common(tokenizer)


def prompt_ids(tokenizer, prompt: Prompt, use_template: bool = True) -> list[int]:
    """The token ids the model continues: the chat template's rendering with the start of the assistant's turn
    where the tokenizer has a template (a plain prompt as one user message), the raw text otherwise."""
    if isinstance(prompt, list) or (use_template and encodes_chats(tokenizer)):
        if not encodes_chats(tokenizer):
            raise UserError("infer: a prompt is a list of messages, and this model's tokenizer has no chat template "
                            "to render it; give plain `prompt` text instead")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if is_mistral_common(tokenizer):  # mistral-common encodes a chat to tokens itself, as the run trained it
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote BOS where it wants one
    return tokenizer(prompt)["input_ids"]


def stop_token_ids(model, tokenizer) -> list[int]:
    """eos (the model's generation config and the tokenizer's), and the end-of-turn token of the chat template."""
    stops = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for token in configured if isinstance(configured, list) else [configured]:
        if token is not None:
            stops.add(int(token))
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    for token in END_OF_TURN_TOKENS:
        if token in template:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is not None and token_id != tokenizer.unk_token_id:
                stops.add(token_id)
    return sorted(stops)


# ---- generating ----------------------------------------------------------------------------------

def generate_all(model, tokenizer, prompts: list[Prompt], settings: GenerationSettings,
                 say: Callable[[str], None] = warn, vision=None, wheres: list[str] | None = None) -> list[str]:
    """The completion of each prompt (new tokens only, special tokens skipped), in the prompts' order. `vision`
    (use/vision.py's VisionPrompts): a vision-language model's, whose prompts may hold images; `wheres` name the
    prompts in its messages."""
    import torch

    from tuneloop.use.vision import prompt_has_images

    images: list[list[str]] = [[] for _ in prompts]
    wheres = wheres or [f"prompt {index + 1}" for index in range(len(prompts))]
    encoded = []
    for index, (prompt, where) in enumerate(zip(prompts, wheres)):
        if vision is not None and prompt_has_images(prompt):  # (a text prompt to a VLM: the text path, --raw too)
            ids, images[index] = vision.encode(prompt, where)
        else:
            ids = prompt_ids(tokenizer, text_only(prompt), settings.use_template)
        encoded.append(ids)
    if getattr(model.config, "is_encoder_decoder", False):  # its encoder was trained on inputs that end with eos
        eos = tokenizer.eos_token_id
        encoded = [ids if eos is None or (ids and ids[-1] == eos) else ids + [eos] for ids in encoded]
    # longest first: an out-of-memory error shows in the first batch, not after most of the work
    order = sorted(range(len(encoded)), key=lambda index: -len(encoded[index]))
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    completions: list[str | None] = [None] * len(encoded)
    batch_size, start = settings.batch_size, 0
    while start < len(order):
        chosen = order[start:start + batch_size]
        try:
            texts = generate_batch(model, tokenizer, [encoded[index] for index in chosen], settings, vision,
                                   [images[index] for index in chosen])
        except RuntimeError as error:  # torch.OutOfMemoryError is a RuntimeError too
            if not is_out_of_memory(error):
                raise
            batch_size = smaller_batch(batch_size, len(chosen), len(encoded[chosen[0]]), say)
            continue  # the same prompts again, fewer at a time (and the rest too: they are no longer)
        for index, text in zip(chosen, texts):
            completions[index] = text
        start += len(chosen)
    return completions


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or CPU_OUT_OF_MEMORY in str(error)


def smaller_batch(batch_size: int, rows: int, longest: int, say: Callable[[str], None]) -> int:
    """Half the batch that ran out of memory, said on stderr; at one prompt a time there is nothing left to halve."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the failed batch's blocks, cached by the allocator, are free for the retry
    if rows <= 1:
        raise UserError(f"infer: out of memory generating a single prompt ({longest} prompt tokens, "
                        "--max-new-tokens more); lower --max-new-tokens, shorten the prompt, or use a device "
                        "with more memory")
    halved = max(1, min(batch_size, rows) // 2)
    say(f"out of memory at batch size {min(batch_size, rows)}; retrying at {halved}")
    return halved


def text_only(prompt: Prompt) -> Prompt:
    """A text model's prompt: messages whose content is a list of text parts get the parts joined (an image part
    was refused before the model loaded)."""
    if isinstance(prompt, str):
        return prompt
    return [{**message, "content": message["content"] if isinstance(message["content"], str)
             else "".join(part["text"] for part in message["content"] if part.get("type") == "text")}
            for message in prompt]


def generate_batch(model, tokenizer, rows: list[list[int]], settings: GenerationSettings, vision=None,
                   images: list[list[str]] | None = None) -> list[str]:
    """One `generate` call on left-padded rows (with their images' pixel inputs, for a vision-language model); each
    row's new tokens, decoded."""
    import torch

    device = next(model.parameters()).device
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=device)
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
    pixels = vision.batch_inputs(input_ids, images, model) if vision is not None and images else {}
    with torch.no_grad():
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **pixels,
                                generation_config=generation_config(model, tokenizer, settings, pad))
    # a decoder-only model continues the prompt; an encoder-decoder's output is its decoder's tokens alone
    new_tokens = output if getattr(model.config, "is_encoder_decoder", False) else output[:, width:]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


def generation_config(model, tokenizer, settings: GenerationSettings, pad: int):
    """The model's own generation config with these settings; sampling options only when sampling (greedy with a
    temperature set makes transformers warn on every call)."""
    import copy

    config = copy.deepcopy(model.generation_config)
    sampling = settings.temperature > 0
    config.do_sample = sampling
    config.temperature = settings.temperature if sampling else None
    config.top_p = settings.top_p if sampling else None
    config.top_k = None  # top-p and temperature are the only filters asked for (a folder's top_k would add one)
    config.max_new_tokens, config.max_length = settings.max_new_tokens, None
    config.pad_token_id, config.eos_token_id = pad, stop_token_ids(model, tokenizer)
    config.use_cache = True
    return config


# ---- the command ---------------------------------------------------------------------------------

def prepare_for_generation(model):
    """Eval mode on the best device here; fp16 weights become fp32 on a CPU (half precision is slow there, and
    some CPU kernels lack it)."""
    import torch

    model.eval()
    if getattr(model, "config", None) is not None:
        model.config.use_cache = True  # a run saves it on, but a folder from elsewhere may say otherwise
    if torch.cuda.is_available():
        return model.to("cuda")
    if next(model.parameters()).dtype == torch.float16:
        model = model.float()
    return model


def print_rows(prompts: list[Prompt], completions: list[str]) -> None:
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
        print(json.dumps({"index": index, "prompt": prompt, "completion": completion}, ensure_ascii=False))
    sys.stdout.flush()


def chat(model, tokenizer, settings: GenerationSettings, lines: Iterable[str] | None = None,
         reply: Callable[[str], None] | None = None) -> None:
    """A conversation: each line read is the user's turn (an empty line, `exit` or the end of input stops),
    each reply printed; the whole conversation so far goes to the model every turn."""
    if not encodes_chats(tokenizer):
        raise UserError("infer: --chat needs a chat template, and this model's tokenizer has none; run without "
                        "--chat to complete plain prompts")
    interactive = lines is None and sys.stdin.isatty()
    lines = sys.stdin if lines is None else lines
    reply = reply or (lambda text: print(text, flush=True))
    messages: list[dict] = []
    one_at_a_time = dataclasses.replace(settings, seed=None, batch_size=1)
    if settings.seed is not None:
        import torch

        torch.manual_seed(settings.seed)  # once: a per-turn reseed would repeat the same random draws
    for line in _turns(lines, interactive):
        messages.append({"role": "user", "content": line})
        answer = generate_all(model, tokenizer, [messages], one_at_a_time)[0]
        messages.append({"role": "assistant", "content": answer})
        reply(answer)


def _turns(lines: Iterable[str], interactive: bool):
    """The user's lines, up to the first empty line or `exit`; a prompt on stderr before each at a terminal."""
    lines = iter(lines)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = next(lines, None)
        if line is None or line.strip() in ("", "exit"):
            return
        yield line.strip()
