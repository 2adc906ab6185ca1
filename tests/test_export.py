"""`tuneloop export --format gguf`, shown by round trips: the file read back by transformers' own GGUF loader
gives the HF folder's logits and tokenization, its metadata reads back as the model's config, and on the
embedded model it holds the very tensors of the llama.cpp-converted file the model was rebuilt from."""

from __future__ import annotations

import json
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CHATML, CORPUS, assert_user_error, run_in_process

from tuneloop.use.folders import find_model_folder
from tuneloop.use.gguf.write import export_gguf

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def held_out_strings(count: int = 100, seed: int = 11) -> list[str]:
    """Text the tokenizers never saw: words out of order, digits, punctuation, runs of spaces and newlines,
    accents and CJK, and half of them rendered as chat turns with their special tokens."""
    rng = random.Random(seed)
    words = " ".join(CORPUS).split() + ["naïve", "日本語", "3.14159", "2025-12-02", "x=y+1;", "  ", "\n\n", "\t"]
    strings = []
    for index in range(count):
        text = " ".join(rng.choices(words, k=rng.randint(1, 14)))
        if index % 2:
            text = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{text[::-1]}<|im_end|>\n"
        strings.append(text)
    return strings


def byte_level_tokenizer(target: Path, split: str | None, template: str, specials: list[str], **names):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names)
    fast.chat_template = template
    fast.save_pretrained(target)
    return fast


def save_model(target: Path, config, model_class) -> Path:
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0: a tensor mapped wrongly shows in the logits
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2: attention biases, a head tied to the embedding, Qwen2's split regex, and 28 embedding rows the
    tokenizer has no token for (the vocabulary padded to a multiple of 64, as Qwen pads it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    target = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = byte_level_tokenizer(target, QWEN2_SPLIT, CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, rope_theta=50000.0)
    return save_model(target, config, Qwen2ForCausalLM)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    """LLaMA-3's shape: its split regex, a BOS the tokenizer adds, its template, and llama3 rope scaling (which
    llama.cpp takes as a rope_freqs tensor)."""
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tmp_path_factory.mktemp("tiny_llama3")
    llama3_split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer = byte_level_tokenizer(target, llama3_split, LLAMA3_TEMPLATE, specials,
                                     bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tokenizer.bos_token_id)])
    tokenizer.save_pretrained(target)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 256})
    return save_model(target, config, LlamaForCausalLM)


def sentencepiece_vocabulary(specials: list[str]) -> tuple[dict, list]:
    """(vocab, merges) of a BPE over "▁"-marked words trained here, with the specials first and the 256 byte
    tokens of byte fallback after them, as sentencepiece lays them out."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer_tokenizer.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=400))
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = {token: index for index, token in enumerate(specials)}
    vocab.update({f"<0x{byte:02X}>": len(specials) + byte for byte in range(256)})
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    return vocab, [tuple(merge) for merge in trained["merges"]]


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def gemma_dir(target: Path, config_class, model_class) -> Path:
    """Gemma's shape: its sentencepiece-style tokenizer (no space prefix), <start_of_turn>/<end_of_turn>, and the
    config's defaults for what llama.cpp fixes (head dimension 256 = query_pre_attn_scalar, the sliding layers)."""
    from transformers import GemmaTokenizer

    tokenizer = GemmaTokenizer(*sentencepiece_vocabulary(["<pad>", "<eos>", "<bos>", "<unk>"]))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(target)
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                          pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return save_model(target, config, model_class)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory) -> Path:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return gemma_dir(tmp_path_factory.mktemp("tiny_gemma2"), Gemma2Config, Gemma2ForCausalLM)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return gemma_dir(tmp_path_factory.mktemp("tiny_gemma3"), Gemma3TextConfig, Gemma3ForCausalLM)


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory) -> Path:
    """LLaMA-2 / Mistral's tokenizer shape: BPE over "▁"-marked words with byte fallback (<0xNN> tokens), built
    by transformers' own LlamaTokenizer from a vocabulary trained here; on a tiny LLaMA with 4 heads of 4 kv."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    target = tmp_path_factory.mktemp("tiny_sentencepiece")
    tokenizer = LlamaTokenizer(*sentencepiece_vocabulary(["<unk>", "<s>", "</s>"]))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(target)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    return save_model(target, config, LlamaForCausalLM)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Mistral, which llama.cpp writes as `llama` (transformers reads it back as a LLaMA)."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    target = tmp_path_factory.mktemp("tiny_mistral")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.save_pretrained(target)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=None, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return save_model(target, config, MistralForCausalLM)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, qwen2_dir) -> Path:
    """Qwen3: the query/key RMS norms, no attention biases, and a head dimension that is not hidden / heads (as
    Qwen3's own: 128; transformers' GGUF reader assumes Qwen3's 128, llama.cpp reads attention.key_length)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    target = tmp_path_factory.mktemp("tiny_qwen3")
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    tokenizer.save_pretrained(target)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    return save_model(target, config, Qwen3ForCausalLM)


def export(model_dir: Path, output: Path, quant: str, **options):
    lines = []
    done = export_gguf(find_model_folder(model_dir, "--model"), output, quant, say=lines.append, **options)
    return done, "\n".join(lines)


def read_back(path: Path, config=None):
    """The file through transformers' GGUF loader; `config`: the model's own, for what the loader cannot read back
    (it ignores rope scaling, which llama.cpp reads from the file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {"config": config} if config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 **options).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def logits(model, tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours: red, green and 42."}],
                                         tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits


def fields(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}


def hf(model_dir: Path, round_to=None):
    """The HF folder's model in float32; `round_to`: its weights rounded through that dtype first (what a file
    that stores them in it holds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if round_to is not None:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim > 1:
                    parameter.copy_(parameter.to(round_to).to(torch.float32))
    return model, AutoTokenizer.from_pretrained(model_dir)


FAMILIES = {  # fixture, llama.cpp architecture, tokenizer.ggml.model, tokenizer.ggml.pre
    "llama": ("tiny_model_dir", "llama", "gpt2", "gpt-2"), "qwen2": ("qwen2_dir", "qwen2", "gpt2", "qwen2"),
    "llama3": ("llama3_dir", "llama", "gpt2", "llama-bpe"),
    "sentencepiece": ("sentencepiece_dir", "llama", "llama", None),
    "mistral": ("mistral_dir", "llama", "gpt2", "gpt-2"), "qwen3": ("qwen3_dir", "qwen3", "gpt2", "qwen2"),
    "gemma2": ("gemma2_dir", "gemma2", "llama", None), "gemma3": ("gemma3_dir", "gemma3", "llama", None),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_f32_export_reads_back_with_the_folders_logits_tokens_template_and_config(name, request, tmp_path):
    """The tiny LLaMA (GQA 4/2, untied head: query/key rows interleaved for llama.cpp and back), Qwen2 (biases,
    tied head, padded vocabulary), a LLaMA-3 (BOS added, rope_freqs), a sentencepiece-style tokenizer (byte
    fallback), Mistral (as llama) and Qwen3 (q/k norms): f32 logits within 1e-5, the same ids for 100 held-out
    strings, the metadata equal to the config, and the template the run's."""
    fixture, gguf_arch, tokenizer_model, pre = FAMILIES[name]
    model_dir = request.getfixturevalue(fixture)
    done, said = export(model_dir, tmp_path / "model.gguf", "f32")
    model, tokenizer = hf(model_dir)
    gguf_model, gguf_tokenizer = read_back(done.gguf)
    if name != "llama3":
        assert (logits(gguf_model, tokenizer) - logits(model, tokenizer)).abs().max().item() <= 1e-5
    else:  # transformers' reader drops the rope scaling: the tensors under the model's own config
        gguf_model, _ = read_back(done.gguf, config=model.config)
        assert (logits(gguf_model, tokenizer) - logits(model, tokenizer)).abs().max().item() <= 1e-5
    for text in held_out_strings():
        assert gguf_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text

    config, meta = model.config, fields(done.gguf)
    arch = meta["general.architecture"]
    assert (arch, meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre")) == (gguf_arch, tokenizer_model, pre)
    assert (meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"], meta[f"{arch}.feed_forward_length"],
            meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"],
            meta[f"{arch}.context_length"], meta[f"{arch}.vocab_size"]) == (
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
        config.num_key_value_heads, config.max_position_embeddings, config.vocab_size)
    assert meta[f"{arch}.attention.key_length"] == meta[f"{arch}.rope.dimension_count"] == (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # Gemma 3: per layer type
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(rope["rope_theta"])
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(config.rms_norm_eps)
    assert meta["tokenizer.chat_template"] == tokenizer.chat_template
    assert meta["tokenizer.ggml.add_bos_token"] is (tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id)
    assert meta["tokenizer.ggml.add_bos_token"] is (name == "llama3")
    tensor_names = {tensor.name for tensor in __import__("gguf").GGUFReader(done.gguf).tensors}
    assert ("output.weight" in tensor_names) is (not config.tie_word_embeddings)
    assert ("rope_freqs.weight" in tensor_names) is (name == "llama3")
    if tokenizer_model == "llama":  # sentencepiece-style: llama.cpp prefixes after every special token too, so a
        # template-driven model is written without the prefix (chat turns tokenize as in HF; llama.cpp itself was
        # checked by benchmarks/llama_cpp_check.py), and the header says what differs
        assert meta["tokenizer.ggml.add_space_prefix"] is False
        assert ("prepend_scheme 'first'" in said) is (name == "sentencepiece")
    if name == "qwen2":  # the rows with no token are there, as unused [PADn] tokens
        assert len(meta["tokenizer.ggml.tokens"]) == config.vocab_size > len(tokenizer)
        assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{config.vocab_size - 1}]"
    assert f"tensors   {len(tensor_names)}, " in said and "as f32: " in said


def test_rope_freqs_are_the_factors_transformers_scales_llama3_rope_by(llama3_dir, tmp_path):
    """The rope_freqs tensor llama.cpp divides the frequencies by: the ratio of transformers' own llama3 inverse
    frequencies to the unscaled ones (transformers' GGUF reader does not read it back, so it is checked here)."""
    import gguf
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    done, _ = export(llama3_dir, tmp_path / "model.gguf", "f32")
    factors = next(t for t in gguf.GGUFReader(done.gguf).tensors if t.name == "rope_freqs.weight").data
    config = AutoConfig.from_pretrained(llama3_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = config.hidden_size // config.num_attention_heads
    plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert torch.allclose(torch.from_numpy(factors.copy()), plain / scaled, rtol=1e-5)


@pytest.mark.parametrize("quant, dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_16_bit_exports_hold_the_weights_rounded_and_nothing_else(quant, dtype, qwen2_dir, tmp_path):
    """At f16/bf16 the file holds each matrix rounded to that type (norms and biases stay f32): its logits equal
    the HF model's with its matrices rounded the same way (1e-5), and stay within 1e-2 of the f32 model's."""
    done, said = export(qwen2_dir, tmp_path / "model.gguf", quant)
    gguf_model, _ = read_back(done.gguf)
    rounded, tokenizer = hf(qwen2_dir, round_to=dtype)
    exact, _ = hf(qwen2_dir)
    assert (logits(gguf_model, tokenizer) - logits(rounded, tokenizer)).abs().max().item() <= 1e-5
    assert (logits(gguf_model, tokenizer) - logits(exact, tokenizer)).abs().max().item() <= 1e-2
    # 2 layers × 7 matrices + the (tied) embedding; 2 × (3 biases + 2 norms) + the final norm
    assert f"26, 0.2 MB as {quant}: 15 {quant.upper()}, 11 F32" in said


QUANTIZED = ["f16", "bf16", "q8_0", "q4_0"]  # each against the f32 export, which the round-trip test reads back


@pytest.mark.parametrize("quant", QUANTIZED)
def test_each_quantization_holds_exactly_the_f32_tensors_in_its_type(quant, qwen2_dir, tmp_path):
    """Tensor by tensor, the file at `quant` holds the f32 export's values quantized by the gguf package itself in
    the type the file states: vectors f32, matrices in the quantization's type, the vocabulary-sized embedding
    q8_0 under q4_0."""
    import gguf
    import numpy as np

    plain, _ = export(qwen2_dir, tmp_path / "f32.gguf", "f32")
    done, _ = export(qwen2_dir, tmp_path / f"{quant}.gguf", quant)
    reference = {tensor.name: tensor for tensor in gguf.GGUFReader(plain.gguf).tensors}
    kinds = set()
    for tensor in gguf.GGUFReader(done.gguf).tensors:
        values = np.asarray(reference[tensor.name].data, dtype=np.float32)
        kind = tensor.tensor_type
        kinds.add((kind.name, len(values.shape) > 1, tensor.name == "token_embd.weight"))
        expected = gguf.dequantize(gguf.quants.quantize(values, kind), kind) if kind.name != "F32" else values
        assert np.array_equal(gguf.dequantize(tensor.data, kind), expected), tensor.name
    matrices = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}[quant]
    embedding = "Q8_0" if quant == "q4_0" else matrices
    assert kinds == {("F32", False, False), (matrices, True, False), (embedding, True, True)}


def test_every_architecture_and_quantization_is_reached_by_a_test(request):
    """Each GGUF_ARCHITECTURES entry is the model type of a family the round-trip test exports, and each
    quantization is one the tests above write."""
    from tuneloop.use.gguf.architectures import GGUF_ARCHITECTURES
    from tuneloop.use.gguf.quantize import QUANTIZATIONS

    reached = {json.loads((request.getfixturevalue(fixture) / "config.json").read_text())["model_type"]
               for fixture, *_ in FAMILIES.values()}
    assert reached == set(GGUF_ARCHITECTURES.names())
    assert set(QUANTIZATIONS.names()) == {"f32", *QUANTIZED}


def test_a_lora_adapter_is_merged_in_memory_and_its_folder_left_as_it_was(tiny_model_dir, tmp_path):
    """--model ADAPTER: the file holds base + adapter (logits of peft's own merge within 1e-5); the adapter folder
    gains nothing but the export."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # B starts at zero: a real update, or the merge would show nothing
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter)
    before = sorted(path.name for path in adapter.iterdir())
    merged = peft_model.merge_and_unload().eval()

    done, said = export(adapter, adapter / "model-f32.gguf", "f32")
    assert "LoRA adapter merged into" in said
    elsewhere = tmp_path / "read" / "model.gguf"  # transformers takes a folder with adapter_config.json for peft's
    elsewhere.parent.mkdir()
    elsewhere.hardlink_to(done.gguf)
    gguf_model, tokenizer = read_back(elsewhere)
    assert (logits(gguf_model, tokenizer) - logits(merged, tokenizer)).abs().max().item() <= 1e-5
    assert sorted(path.name for path in adapter.iterdir()) == sorted(before + ["model-f32.gguf",
                                                                               "model-f32.Modelfile"])


def test_the_modelfile_translates_a_template_only_when_it_renders_the_same(tiny_model_dir, llama3_dir, tmp_path):
    """ChatML and LLaMA-3 become Ollama TEMPLATEs (checked by rendering probe conversations both ways); a template
    with no translation gets none and says so; the stop tokens are the turn end and the eos."""
    from transformers import AutoTokenizer

    chatml, _ = export(tiny_model_dir, tmp_path / "chatml.gguf", "q8_0")
    text = chatml.modelfile.read_text()
    assert text.startswith("# Written by tuneloop export") and "FROM ./chatml.gguf\n" in text
    assert 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "<|endoftext|>"' in text
    assert fields(chatml.gguf)["tokenizer.ggml.eot_token_id"] == \
        AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("<|im_end|>")

    llama3, _ = export(llama3_dir, tmp_path / "llama3.gguf", "q8_0")
    assert "<|start_header_id|>{{ .Role }}<|end_header_id|>" in llama3.modelfile.read_text()
    assert "<|begin_of_text|>" not in llama3.modelfile.read_text()  # the tokenizer adds BOS (add_bos_token)

    odd = tmp_path / "odd"
    odd.mkdir()
    for path in tiny_model_dir.iterdir():
        (odd / path.name).write_bytes(path.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(odd)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(odd)
    untranslated, said = export(odd, tmp_path / "odd.gguf", "q8_0")
    assert "TEMPLATE" not in untranslated.modelfile.read_text().replace("template from", "")
    assert "no Ollama translation" in untranslated.modelfile.read_text() and "not translated" in said
    assert fields(untranslated.gguf)["tokenizer.chat_template"] == tokenizer.chat_template


def test_export_refuses_what_it_cannot_write_and_never_replaces_a_file_it_did_not_write(tiny_model_dir, gemma2_dir,
                                                                                        tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    output = tmp_path / "model.gguf"
    first = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(output), "--quant", "f16")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "exported" in first.stdout and "ollama create" in first.stdout and "llama-cli" in first.stdout
    again = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(output))
    assert_user_error(again, f"{output} exists", "--overwrite")
    replaced = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(output), "--overwrite")
    assert replaced.returncode == 0 and fields(output)["general.file_type"] == 7  # q8_0 now

    theirs = tmp_path / "theirs.gguf"
    theirs.write_bytes(b"GGUF someone else's file")
    refused = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(theirs), "--overwrite")
    assert_user_error(refused, "is not a file tuneloop exported", "never replaces")
    assert theirs.read_bytes() == b"GGUF someone else's file"

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=420)).save_pretrained(gpt2)
    assert_user_error(run_in_process("export", "--model", str(gpt2)), "does not know the architecture 'gpt2'",
                      "'llama', 'mistral', 'qwen2', 'qwen3', 'gemma2' or 'gemma3_text'")
    assert not list(gpt2.glob("*.gguf"))

    for key, value, said in (("query_pre_attn_scalar", 64, "scales its queries by query_pre_attn_scalar 64"),
                             ("layer_types", ["full_attention", "sliding_attention"], "fixes one full-attention")):
        changed = tmp_path / f"gemma2-{key}"
        changed.mkdir()
        for path in gemma2_dir.iterdir():
            (changed / path.name).write_bytes(path.read_bytes())
        config = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**config, key: value}))
        assert_user_error(run_in_process("export", "--model", str(changed)), said, "would compute another model")

    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert_user_error(run_in_process("export", "--model", str(no_tokenizer)), "no tokenizer in")
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--quant", "q2_k"),
                      "--quant", "q2_k")
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--output", str(tmp_path / "m.bin")),
                      "does not end in .gguf")


@pytest.mark.slow  # (a process of its own)
def test_a_write_that_fails_half_way_leaves_no_file_and_the_old_one_whole(tiny_model_dir, tmp_path):
    """A file-size limit (the kernel's RLIMIT_FSIZE: writes past it fail as on a full disk) stops the write half
    way: exit 2 with one message, no torn file where llama.cpp would look, no temporary left, and the file an
    earlier export wrote there still whole."""
    output = tmp_path / "model.gguf"
    export(tiny_model_dir, output, "f16")
    old = output.read_bytes()

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(old) // 2, len(old) // 2))

    result = subprocess.run([sys.executable, "-m", "tuneloop", "export", "--model", str(tiny_model_dir), "--output",
                             str(output), "--quant", "f32", "--overwrite"], capture_output=True, text=True,
                            preexec_fn=limit_file_size, timeout=300)
    assert_user_error(result, "nothing was written")
    assert output.read_bytes() == old
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.Modelfile", "model.gguf"]


def test_an_export_inside_a_run_is_recorded_as_the_runs_own(tiny_model_dir, tmp_path):
    """In a run's output_dir the file and the Modelfile are the run's (`train --overwrite` may clear them)."""
    from tuneloop import run_files

    out = tmp_path / "out"
    out.mkdir()
    for path in tiny_model_dir.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    run_files.record(out, "config.json")
    done, _ = export(out, out / "model-q8_0.gguf", "q8_0")
    assert {"model-q8_0.gguf", "model-q8_0.Modelfile"} <= run_files.written_names(out)
    assert {path.name for path in run_files.run_files_in(out)} >= {"model-q8_0.gguf", "model-q8_0.Modelfile"}


@pytest.mark.slow
def test_the_embedded_models_export_holds_the_tensors_of_the_llama_cpp_file_it_came_from(tmp_path):
    """The embedded SmolLM2 was rebuilt from a GGUF that llama.cpp's own converter wrote (its Q4_1 weights
    dequantized). Exported at f32, every tensor of ours equals that file's, dequantized, exactly: names, shapes,
    the query/key interleaving and the tied head are llama.cpp's; so are the architecture keys and the special
    tokens."""
    import gguf

    from tuneloop.demo.embedded import ensure_embedded_model, find_smollm2_gguf

    done, _ = export(ensure_embedded_model(), tmp_path / "smollm2.gguf", "f32")
    original, ours = gguf.GGUFReader(find_smollm2_gguf()), gguf.GGUFReader(done.gguf)
    theirs = {tensor.name: tensor for tensor in original.tensors}
    assert sorted(theirs) == sorted(tensor.name for tensor in ours.tensors)
    for tensor in ours.tensors:
        expected = gguf.dequantize(theirs[tensor.name].data, theirs[tensor.name].tensor_type)
        assert (tensor.data == expected).all(), tensor.name
    same = [key for key in original.fields if key.startswith("llama.") or key in (
        "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
        "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")]
    assert len(same) == 19
    for key in same:
        assert ours.fields[key].contents() == original.fields[key].contents(), key


def tokenizer_variant(model_dir: Path, target: Path, *, normalizer=None, pre_tokenizer=None, byte_fallback=False):
    """The tiny LLaMA with a tokenizer of another shape (trained here, at most as many tokens as the model has rows)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (target / name).write_bytes((model_dir / name).read_bytes())
    tokenizer = Tokenizer(models.BPE(byte_fallback=byte_fallback, unk_token="<unk>" if byte_fallback else None))
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteFallback() if byte_fallback else decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if not byte_fallback else [])
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(target)
    return target


def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused_naming_what_it_does(tiny_model_dir, tmp_path):
    """A prefix space before byte-level BPE, a normalizer llama.cpp does not apply, byte fallback behind a split
    that is not sentencepiece's: each loads in llama.cpp and tokenizes differently (seen there), so each is exit 2."""
    from tokenizers import normalizers, pre_tokenizers

    for name, shape, said in (
            ("prefix", {"pre_tokenizer": pre_tokenizers.ByteLevel(add_prefix_space=True)}, "add_prefix_space: true"),
            ("lowercase", {"normalizer": normalizers.Lowercase()}, "normalizes text first"),
            ("whitespace", {"pre_tokenizer": pre_tokenizers.Whitespace(), "byte_fallback": True},
             "splits text before its merges")):
        folder = tokenizer_variant(tiny_model_dir, tmp_path / name, **shape)
        assert_user_error(run_in_process("export", "--model", str(folder)), said, "tokenize text differently")
        assert not list(folder.glob("*.gguf")) and not list(folder.glob(".tmp-*"))


def test_overwrite_leaves_a_file_changed_since_tuneloop_wrote_it(tiny_model_dir, tmp_path):
    """A GGUF whose recorded type no longer matches (llama-quantize copies the marker key into its output) and an
    edited Modelfile are the user's now: --overwrite refuses them and leaves them as they are."""
    output = tmp_path / "model.gguf"
    export(tiny_model_dir, output, "f16")
    data = output.read_bytes()
    marker = b"file_type=1 "
    assert data.count(marker) == 1
    output.write_bytes(data.replace(marker, b"file_type=7 "))  # what another tool's rewrite of the file looks like
    changed = output.read_bytes()
    refused = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(output), "--overwrite")
    assert_user_error(refused, "is not a file tuneloop exported (or it changed since)")
    assert output.read_bytes() == changed

    again = tmp_path / "again.gguf"
    done, _ = export(tiny_model_dir, again, "q8_0")
    done.modelfile.write_text(done.modelfile.read_text() + "PARAMETER temperature 0.2\n")
    refused = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(again), "--overwrite")
    assert_user_error(refused, str(done.modelfile), "is not a file tuneloop exported")
    assert "temperature 0.2" in done.modelfile.read_text()


def test_what_a_killed_export_left_is_removed_and_a_folder_that_cannot_be_made_is_said(tiny_model_dir, tmp_path):
    left = tmp_path / ".tmp-model.gguf-k1ll3d"
    left.write_bytes(b"half a file")
    lock = tmp_path / ".model.gguf.lock"  # a kill -9 leaves its lock file too (unlocked: the process is gone)
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "before"}))
    mine = tmp_path / ".tmp-notes.txt"
    mine.write_text("not an export's")
    result = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(tmp_path / "model.gguf"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"removed {left}" in result.stdout and not left.exists() and not lock.exists() and mine.exists()
    (tmp_path / "afile").write_text("")
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--output",
                                     str(tmp_path / "afile" / "model.gguf")), "cannot make the folder")


def test_two_exports_into_one_file_never_take_each_others_temporary(tiny_model_dir, tmp_path, monkeypatch):
    """A first export held while its temporary is being written (a thread here, stopped by an event, not by timing):
    a second export of the same file is refused in one line naming it and leaves the first's temporary alone, and
    the first then finishes whole. (What an export that is gone left is still removed:
    test_what_a_killed_export_left_is_removed_and_a_folder_that_cannot_be_made_is_said.)"""
    import threading

    from tuneloop.use.gguf import write

    output = tmp_path / "model.gguf"
    writing, finish = threading.Event(), threading.Event()
    original = write._write_file

    def held_once(path, *args):
        if not writing.is_set():  # the first export's write waits for the test; any other goes on
            writing.set()
            assert finish.wait(120)
        return original(path, *args)

    monkeypatch.setattr(write, "_write_file", held_once)
    first = {}

    def export_first():
        try:
            first["done"] = export_gguf(find_model_folder(tiny_model_dir, "--model"), output, "f16",
                                        say=lambda line: None)
        except BaseException as error:  # (said by the test's thread below)
            first["error"] = error

    thread = threading.Thread(target=export_first)
    thread.start()
    try:
        assert writing.wait(120), first
        in_progress = list(tmp_path.glob(".tmp-model.gguf-*"))
        assert len(in_progress) == 1
        second = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(output), "--quant", "f16")
        assert in_progress[0].exists()
    finally:
        finish.set()
        thread.join(120)
    assert_user_error(second, f"another export is writing {output}", "wait for it to end")
    assert "removed" not in second.stdout and "disk" not in second.stderr
    assert "error" not in first, repr(first.get("error"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.Modelfile", "model.gguf"]  # nothing else left
    assert fields(output)["general.file_type"] == 1  # f16, whole


def test_without_file_locks_a_temporary_is_left_with_a_note(tiny_model_dir, tmp_path, monkeypatch):
    """A file system that gives no locks (flock fails): whether another export still writes a temporary cannot be
    known, so it is left, and said."""
    import errno
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    left = tmp_path / ".tmp-model.gguf-wr1t1ng"
    left.write_bytes(b"maybe another export's")
    result = run_in_process("export", "--model", str(tiny_model_dir), "--output", str(tmp_path / "model.gguf"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"note: left {left}" in result.stdout and left.read_bytes() == b"maybe another export's"
    assert sorted(path.name for path in tmp_path.iterdir()) == [left.name, "model.Modelfile", "model.gguf"]

# ---- what export says when it cannot, in one line naming the path and the fix -------------------------------------

def test_a_llama_cpp_quantization_export_cannot_write_says_how_to_get_it(tiny_model_dir, tmp_path):
    """`--quant Q4_K_M` (a k-quant the gguf package cannot write): one line with llama.cpp's own way to it, not
    argparse's usage; the spelling llama.cpp uses for a type export writes (Q8_0) is that type."""
    f16 = tiny_model_dir / "model-f16.gguf"
    refused = run_in_process("export", "--model", str(tiny_model_dir), "--quant", "Q4_K_M")
    assert_user_error(refused, "--quant Q4_K_M", "--quant f16", f"llama-quantize {f16} "
                      f"{tiny_model_dir / 'model-Q4_K_M.gguf'} Q4_K_M")
    assert "usage:" not in refused.stderr
    assert_user_error(run_in_process("export", "--model", str(tiny_model_dir), "--quant", "q9_x"),
                      "--quant q9_x is not one of --format gguf's")
    spelled = run_in_process("export", "--model", str(tiny_model_dir), "--quant", "Q8_0", "--output",
                             str(tmp_path / "model.gguf"))
    assert spelled.returncode == 0, spelled.stderr[-2000:]
    assert fields(tmp_path / "model.gguf")["general.file_type"] == 7  # q8_0


def test_an_adapter_whose_base_moved_is_said_with_how_to_point_at_it(tiny_model_dir, tmp_path):
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = shutil.copytree(tiny_model_dir, tmp_path / "base")
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"])
                   ).save_pretrained(adapter)
    base.rename(tmp_path / "moved")
    refused = run_in_process("export", "--model", str(adapter))
    assert_user_error(refused, str(base), "is not there", "--base DIR")
    assert "Repo id" not in refused.stderr
    assert run_in_process("export", "--model", str(adapter), "--base", str(tmp_path / "moved")).returncode == 0


def test_export_of_a_folder_a_run_is_training_in_says_so(tiny_model_dir, tmp_path):
    """The run's lock on output_dir (run_files.OutputDirLock, as `train` holds it) is how tuneloop knows a run is
    live: export refuses the folder, naming the run; once the run has ended it exports."""
    import os
    import shutil

    from conftest import base_config, tiny_rows, write_config, write_jsonl

    from tuneloop import run_files

    out = shutil.copytree(tiny_model_dir, tmp_path / "out")  # (an earlier run's model, which the run there replaces)
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir,
                                                              write_jsonl(tmp_path / "d.jsonl", tiny_rows(4))))
    training = run_files.OutputDirLock(out)
    training.sign()
    try:
        refused = run_in_process("export", str(config), "--quant", "f16")
    finally:
        training.close()
    assert_user_error(refused, f"a run is training in {out}", f"pid {os.getpid()}", "wait for it to end")
    assert not list(out.glob("*.gguf"))
    assert run_in_process("export", str(config), "--quant", "f16").returncode == 0


@pytest.mark.slow
def test_sigterm_while_writing_leaves_neither_a_file_nor_a_temporary(tmp_path):
    """The embedded model at f32 (540 MB, a few seconds to write): SIGTERM once the temporary appears; exit 143, and
    the folder holds what it held before."""
    import os
    import time

    from tuneloop.demo.embedded import ensure_embedded_model

    process = subprocess.Popen([sys.executable, "-m", "tuneloop", "export", "--model", str(ensure_embedded_model()),
                                "--quant", "f32", "--output", str(tmp_path / "model.gguf")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".tmp-model.gguf-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the export ended before it could be interrupted"
    time.sleep(0.3)  # in the middle of the tensors
    os.kill(process.pid, signal.SIGTERM)
    process.communicate(timeout=120)
    assert process.returncode == 143
    assert list(tmp_path.iterdir()) == []
