"""Does llama.cpp itself load what `tuneloop export` writes, and compute what the HF model computes?

The test suite proves the GGUF files by reading them back with transformers' own GGUF loader; that does not
prove llama.cpp loads them. This check does, where `llama-cpp-python` (llama.cpp's Python binding, compiled
from source on install: about 9 minutes on 2 cores) can be installed; it is not a dependency of tuneloop.

    python -m venv /tmp/llama && /tmp/llama/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/llama_cpp_check.py --llama-python /tmp/llama/bin/python [--model DIR ...]

For each model folder (default: the embedded SmolLM2, and first as a reference the llama.cpp-converted Q4_1 file
whose dequantized weights the embedded model holds) and each quantization it exports the model, then compares
llama.cpp against the HF model in float32: the token ids of 100 held-out strings (chat turns with their special
tokens among them), the logits over a chat prompt (max |Δ| and whether every position's argmax agrees), and
16 greedy tokens after it. The HF side runs in this interpreter; llama.cpp in `--llama-python` (it re-runs this
file with --inner).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = ("The quick brown fox jumps over the lazy dog . Hello there , how are you today ? naïve café 日本語 "
         "3.14159 2025-12-02 x=y+1; can't won't (parenthesis) [brackets] {braces} \"quotes\" tabs\t new\nlines"
         ).split(" ")
QUESTION = "What is the capital of France?"


def held_out_strings(count: int = 100, seed: int = 5) -> list[str]:
    rng = random.Random(seed)
    strings = []
    for index in range(count):
        text = " ".join(rng.choices(WORDS, k=rng.randint(1, 16)))
        if index % 2:  # half as chat turns, special tokens and all
            text = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        strings.append(text)
    return strings


def inner(request_path: str, result_path: str) -> None:
    """Under the llama-cpp-python interpreter: tokenize, score the prompt, generate greedily."""
    import numpy as np
    from llama_cpp import Llama

    request = json.loads(Path(request_path).read_text())
    llm = Llama(model_path=request["gguf"], n_ctx=1024, logits_all=True, verbose=False, n_threads=2, seed=0)
    tokens = [llm.tokenize(text.encode(), add_bos=True, special=True) for text in request["strings"]]
    prompt = request["prompt_ids"]
    llm.eval(prompt)
    logits = np.array(llm.scores[:len(prompt)], dtype=np.float32)  # a copy: later calls reuse llm.scores in place
    llm.reset()
    greedy = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        if len(greedy) == request["new_tokens"]:
            break
        greedy.append(int(token))
    chat = llm.create_chat_completion(messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
                                      temperature=0.0, top_k=1)["choices"][0]["message"]["content"]
    np.save(result_path + ".npy", logits)
    Path(result_path).write_text(json.dumps({"tokens": tokens, "greedy": greedy, "chat": chat}))


def check(model_dir: Path, quant: str, llama_python: str, work: Path, existing: Path | None = None) -> dict:
    """`existing`: a GGUF file to check as it is (llama.cpp's own conversion of the same weights) instead of an
    export at `quant`."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneloop.use.folders import find_model_folder
    from tuneloop.use.gguf.write import export_gguf

    if existing is None:
        output = work / f"{model_dir.name}-{quant}.gguf"
        export_gguf(find_model_folder(model_dir, "--model"), output, quant, overwrite=True, say=lambda line: None)
    else:
        output = existing
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text)["input_ids"]
    strings = held_out_strings()
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].numpy()
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None, pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
    request, result = work / "request.json", work / "result.json"
    request.write_text(json.dumps({"gguf": str(output), "strings": strings, "prompt_ids": prompt, "new_tokens": 16}))
    subprocess.run([llama_python, __file__, "--inner", str(request), str(result)], check=True)
    answer = json.loads(result.read_text())
    logits = np.load(str(result) + ".npy")
    same = [tokenizer(text)["input_ids"] == ids for text, ids in zip(strings, answer["tokens"])]
    same_tokens = f"{sum(same[0::2])} + {sum(same[1::2])}"  # plain text + chat turns, 50 each
    return {"model": model_dir.name, "quant": quant, "MB": output.stat().st_size / 1e6, "tokens_same": same_tokens,
            "max_abs_logit_diff": float(np.abs(logits - reference).max()),
            "argmax_same": bool((logits.argmax(-1) == reference.argmax(-1)).all()),
            "greedy_same": answer["greedy"] == generated,
            "hf_text": tokenizer.decode(generated), "llama_cpp_text": tokenizer.decode(answer["greedy"]),
            "llama_cpp_chat": answer["chat"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--llama-python", default=sys.executable,
                        help="an interpreter with llama-cpp-python installed (default: this one)")
    parser.add_argument("--model", action="append", type=Path, help="a model folder (default: the embedded model)")
    parser.add_argument("--quants", nargs="+", default=["f32", "f16", "q8_0", "q4_0"])
    args = parser.parse_args()
    if args.inner:
        inner(*args.inner)
        return
    if subprocess.run([args.llama_python, "-c", "import llama_cpp"], capture_output=True).returncode:
        sys.exit(f"llama_cpp_check: {args.llama_python} cannot import llama_cpp; install llama-cpp-python there "
                 "(see this file's docstring), or pass --llama-python")
    from tuneloop.demo.embedded import ensure_embedded_model, find_smollm2_gguf

    models = args.model or [ensure_embedded_model()]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        if not args.model:  # the reference: llama.cpp's own converted file, whose weights the embedded model holds
            rows.append(check(models[0], "Q4_1 (llama.cpp's file)", args.llama_python, Path(work), find_smollm2_gguf()))
            print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
        for model_dir in models:
            for quant in args.quants:
                rows.append(check(model_dir, quant, args.llama_python, Path(work)))
                print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
    print("\n| model | quant | MB | same ids (plain + chat, of 50 + 50) | max abs Δ logit vs HF f32 | argmax same | "
          "16 greedy tokens same |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['quant']} | {row['MB']:.1f} | {row['tokens_same']} | "
              f"{row['max_abs_logit_diff']:.3g} | {'yes' if row['argmax_same'] else 'no'} | "
              f"{'yes' if row['greedy_same'] else 'no'} |")


if __name__ == "__main__":
    main()
