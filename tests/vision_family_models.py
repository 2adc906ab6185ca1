"""Tiny Gemma 3, Idefics3, SmolVLM and Mllama models and processors, built here from configs (nothing downloaded):
hidden sizes of 32–64, one or two layers, 28-pixel vision patches. test_vision_families.py trains them."""

from __future__ import annotations

from pathlib import Path

from test_vision_language import tiny_tokenizer

# SmolVLM's own template (the tokenizer's default: axolotl names none for the family), for text content
SMOLVLM_TEMPLATE = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
                    "{{ ':' if message['content'].startswith('<image>') else ': ' }}{{ message['content'] }}"
                    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def save_gemma3(target: Path) -> Path:
    """Gemma 3: a 1-layer SigLIP tower over 28×28 images (2×2 patches of 14 -> 4 soft tokens), a 2-layer decoder."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    from tuneloop.data.chat_template_texts import GEMMA3

    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                "<image_soft_token>"]
    tokenizer = tiny_tokenizer(specials, "<eos>", "<pad>", bos_token="<bos>", extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=GEMMA3,
                    image_seq_length=4).save_pretrained(target)
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=32, max_position_embeddings=512, pad_token_id=ids("<pad>"),
                         eos_token_id=ids("<eos>"), bos_token_id=ids("<bos>")),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"))
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(target)
    return target


def _idefics_tokenizer():
    specials = (["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                 "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
    return tiny_tokenizer(specials, "<end_of_utterance>", "<|endoftext|>")


def _idefics_config(config_class, tokenizer):
    """A 1-layer SigLIP-like tower over 28-pixel tiles (2×2 patches of 14, pixel-shuffled 2× -> 1 token a tile)."""
    return config_class(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id)


def save_idefics3(target: Path) -> Path:
    """Idefics3: images longer than 28 pixels split into 28-pixel tiles (a 56×56 square: 2×2 tiles and the global
    image, 1 image token each), a 2-layer LLaMA."""
    import torch
    from transformers import Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor
    from transformers.models.idefics3 import Idefics3Config

    tokenizer = _idefics_tokenizer()
    tokenizer.chat_template = SMOLVLM_TEMPLATE
    images = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=1,
                      chat_template=SMOLVLM_TEMPLATE).save_pretrained(target)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(_idefics_config(Idefics3Config, tokenizer)).save_pretrained(target)
    return target


def save_smolvlm(target: Path) -> Path:
    """SmolVLM: Idefics3's layout (the same tiles); its processor needs torchvision (videos) and num2words, not
    installed here, so the folder holds the image processor and tokenizer."""
    import torch
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil

    tokenizer = _idefics_tokenizer()
    tokenizer.chat_template = SMOLVLM_TEMPLATE
    tokenizer.save_pretrained(target)
    SmolVLMImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28}).save_pretrained(target)
    torch.manual_seed(0)
    SmolVLMForConditionalGeneration(_idefics_config(SmolVLMConfig, tokenizer)).save_pretrained(target)
    return target


def save_mllama(target: Path) -> Path:
    """Mllama: one `<|image|>` token per image, read by a cross-attention layer; images in up to 2 tiles of 28
    pixels (2×2 patches of 14), a 1-layer tower with 1 global layer, a 2-layer decoder (layer 1 cross-attends)."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessorPil, MllamaProcessor

    from tuneloop.data.chat_template_texts import LLAMA3_2_VISION

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|image|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
    tokenizer = tiny_tokenizer(specials, "<|eot_id|>", "<|finetune_right_pad_id|>", bos_token="<|begin_of_text|>")
    images = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2)
    MllamaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=LLAMA3_2_VISION).save_pretrained(target)
    ids = tokenizer.convert_tokens_to_ids
    config = MllamaConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         cross_attention_layers=[1], pad_token_id=ids("<|finetune_right_pad_id|>"),
                         bos_token_id=ids("<|begin_of_text|>"), eos_token_id=ids("<|eot_id|>")),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
                           attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2,
                           intermediate_layers_indices=[0], vision_output_dim=64,
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
        image_token_index=ids("<|image|>"))
    torch.manual_seed(0)
    MllamaForConditionalGeneration(config).save_pretrained(target)
    return target
