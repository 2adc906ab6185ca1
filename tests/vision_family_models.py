"""Tiny Gemma 3, Idefics3, SmolVLM, Mllama and Mistral 3 models and processors, built here from configs (nothing downloaded):
hidden sizes of 32–64, one or two layers, 28-pixel vision patches (Qwen3-VL/3.5: 16-pixel, as theirs are), and
Qwen3-VL, Qwen3.5 and InternVL folders with their image processor and tokenizer (their processors need torchvision),
and PaddleOCR-VL with its whole processor.
test_vision_families.py trains them. TWINS (at the end) names every vision family's tiny twin: a family tuneloop
trains (a VisionFamily record in tuneloop/vision_families/) has one here (test_vision_family_records.py holds it)."""

from __future__ import annotations

from pathlib import Path

from test_vision_language import save_llava, save_qwen2_vl, tiny_tokenizer

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


def save_mistral3(target: Path) -> Path:
    """Mistral 3: a 1-layer Pixtral tower with 14-pixel patches merged 2×2 (28 pixels a token), images within a
    56-pixel longest edge (a 56×56 square: 2 rows of 2 [IMG], [IMG_BREAK] between them, [IMG_END] last), a 2-layer
    Mistral.
    Its PixtralProcessor needs torchvision (not installed here): the folder holds what the hub's does, the processor's
    settings (processor_config.json), its PIL image processor and the tokenizer."""
    import json

    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessorPil

    from tuneloop.data.chat_template_texts import MISTRAL_V7_TEKKEN

    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                "[IMG_BREAK]", "[IMG_END]", "<pad>"]
    tokenizer = tiny_tokenizer(specials, "</s>", "<pad>", bos_token="<s>", unk_token="<unk>")
    tokenizer.chat_template = MISTRAL_V7_TEKKEN  # (the hub folders' tokenizer carries its template)
    tokenizer.save_pretrained(target)
    PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14}).save_pretrained(target)
    (target / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2, "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, sliding_window=None, pad_token_id=ids("<pad>"),
                         bos_token_id=ids("<s>"), eos_token_id=ids("</s>")),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=16, patch_size=14, image_size=56),
        spatial_merge_size=2, image_token_index=ids("[IMG]"), tie_word_embeddings=False)
    torch.manual_seed(0)
    Mistral3ForConditionalGeneration(config).save_pretrained(target)
    return target


def _qwen3_vl_folder(target: Path, template: str):
    """Qwen3-VL's and Qwen3.5's folder without their processor (it needs torchvision for videos, not installed
    here): the tokenizer and Qwen2-VL's image processor as their hub folders configure it, 16-pixel patches
    merged 2×2, 32×32..64×64 pixels (1–4 image tokens). Returns the token ids the model config names."""
    from transformers import Qwen2VLImageProcessorPil

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    tokenizer = tiny_tokenizer(specials, "<|im_end|>", "<|endoftext|>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(target)
    Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=16, merge_size=2,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(target)
    ids = tokenizer.convert_tokens_to_ids
    return len(tokenizer), dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                                vision_start_token_id=ids("<|vision_start|>"),
                                vision_end_token_id=ids("<|vision_end|>"))


# the vision tower both share: one block, 16-pixel patches, a 4×4 grid of learned positions (interpolated)
_QWEN3_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=16,
                     spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def save_qwen3_vl(target: Path) -> Path:
    """Qwen3-VL: the shared tower with a DeepStack merger after its block (its features added to the decoder's first
    layer), a 2-layer decoder with interleaved M-RoPE."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tuneloop.data.chat_template_texts import QWEN2_VL

    vocab, ids = _qwen3_vl_folder(target, QWEN2_VL)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(_QWEN3_VISION, deepstack_visual_indexes=[0]), **ids)
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(target)
    return target


def save_qwen3_vl_moe(target: Path) -> Path:
    """Qwen3-VL-MoE (the 30B-A3B's architecture): Qwen3-VL's tower and decoder, its MLPs 2 experts (1 a token)."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from tuneloop.data.chat_template_texts import QWEN2_VL

    vocab, ids = _qwen3_vl_folder(target, QWEN2_VL)
    config = Qwen3VLMoeConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=2, num_experts_per_tok=1, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(_QWEN3_VISION, deepstack_visual_indexes=[0]), **ids)
    torch.manual_seed(0)
    Qwen3VLMoeForConditionalGeneration(config).save_pretrained(target)
    return target


def save_qwen3_5(target: Path) -> Path:
    """Qwen3.5 (the 9B's architecture): the shared tower, a 2-layer decoder of one gated delta-net (linear attention)
    layer and one full-attention layer, M-RoPE over a quarter of each head."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return _save_qwen3_5(target, Qwen3_5Config, Qwen3_5ForConditionalGeneration, intermediate_size=128)


def save_qwen3_5_moe(target: Path) -> Path:
    """Qwen3.5-MoE (the 35B-A3B's architecture): Qwen3.5's, its MLPs 4 experts (2 a token) and a shared expert."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    return _save_qwen3_5(target, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _save_qwen3_5(target: Path, config_class, model_class, **mlp) -> Path:
    import torch

    from tuneloop.data.chat_template_texts import QWEN3_5

    vocab, ids = _qwen3_vl_folder(target, QWEN3_5)
    config = config_class(
        text_config=dict(vocab_size=vocab, hidden_size=64, **mlp, num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        vision_config=_QWEN3_VISION, **ids)
    torch.manual_seed(0)
    model_class(config).save_pretrained(target)
    return target


# GLM-4.1V's hub template over text content (zai-org/GLM-4.1V-9B-Thinking: [gMASK]<sop>, a role tag and newline
# before each message), without its thinking block
GLM4V_TEMPLATE = ("[gMASK]<sop>{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def save_glm4v(target: Path, moe: bool = False) -> Path:
    """GLM-4.1V (moe: GLM-4.5V/4.6V, its MLPs after the first layer 2 routed experts, 1 a token, and a shared one):
    its folder without its processor (it needs torchvision for videos, not installed here): the tokenizer and the PIL
    twin of its image processor, 14-pixel patches merged 2×2, 28×28..56×56 pixels (1–4 image tokens); a 1-block
    tower whose 4×4 grid of learned positions is interpolated, its 2×2 downsampling convolution and merger; a 2-layer
    decoder with M-RoPE
    over half of each head."""
    import torch
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Glm4vImageProcessorPil
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    specials = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
                "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"]
    tokenizer = tiny_tokenizer(specials, "<|endoftext|>", "<|endoftext|>")
    tokenizer.chat_template = GLM4V_TEMPLATE
    tokenizer.save_pretrained(target)
    # (its size bounds the pixels of 2 frames: an image counts twice)
    Glm4vImageProcessorPil(size={"shortest_edge": 2 * 28 * 28, "longest_edge": 2 * 56 * 56}, patch_size=14,
                           merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(target)
    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1]})
    if moe:
        text.update(head_dim=16, moe_intermediate_size=32, n_routed_experts=2, num_experts_per_tok=1,
                    n_shared_experts=1, first_k_dense_replace=1)
    config = (Glm4vMoeConfig if moe else Glm4vConfig)(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, image_size=56,
                           out_hidden_size=64, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"))
    torch.manual_seed(0)
    (Glm4vMoeForConditionalGeneration if moe else Glm4vForConditionalGeneration)(config).save_pretrained(target)
    return target


# InternVL's hub template (OpenGVLab/InternVL3_5-*-HF) over text content: ChatML, the content as it is
INTERNVL_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                     "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                     "{% endif %}")


def save_internvl(target: Path) -> Path:
    """InternVL 3.5: images cut into 28-pixel tiles (up to 4) plus a thumbnail when there is more than one, a 1-layer
    InternViT tower (2×2 patches of 14 with a class position) pixel-shuffled by 0.5 to 1 token a tile, a 2-layer
    Qwen2 decoder. Its processor needs torchvision (videos): the folder holds the image processor and tokenizer
    (whose image tokens the processor would read)."""
    import torch
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    tokenizer = tiny_tokenizer(specials, "<|im_end|>", "<|endoftext|>", extra_special_tokens={
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"})
    tokenizer.chat_template = INTERNVL_TEMPLATE
    tokenizer.save_pretrained(target)
    GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, max_patches=4).save_pretrained(target)
    config = InternVLConfig(
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=1, downsample_ratio=0.5)
    torch.manual_seed(0)
    InternVLForConditionalGeneration(config).save_pretrained(target)
    return target


# PaddleOCR-VL's hub template (PaddlePaddle/PaddleOCR-VL, ERNIE's turns) over text content: the content as it is
PADDLEOCR_VL_TEMPLATE = ("<|begin_of_sentence|>{% for message in messages %}{% if message['role'] == 'user' %}"
                         "{{ 'User: ' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}"
                         "{{ 'Assistant: ' + message['content'] + '<|end_of_sentence|>' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")


def save_paddleocr_vl(target: Path) -> Path:
    """PaddleOCR-VL: a 1-layer NaViT tower over 14-pixel patches (a 4×4 grid of learned positions, interpolated),
    its projector merging 2×2 patches to a token, 28×28..56×56 pixels (1–4 image tokens), a 2-layer ERNIE decoder
    with M-RoPE. Its processor needs no torchvision: the folder holds it whole."""
    import torch
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration, PaddleOCRVLImageProcessorPil
    from transformers import PaddleOCRVLProcessor

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|begin_of_sentence|>", "<|end_of_sentence|>", "<|IMAGE_START|>",
                "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>", "<|video_pad|>"]
    tokenizer = tiny_tokenizer(specials, "</s>", "<pad>", bos_token="<s>", unk_token="<unk>",
                               extra_special_tokens={"image_token": "<|IMAGE_PLACEHOLDER|>"})
    tokenizer.chat_template = PADDLEOCR_VL_TEMPLATE
    images = PaddleOCRVLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56})
    PaddleOCRVLProcessor(image_processor=images, tokenizer=tokenizer,
                         chat_template=PADDLEOCR_VL_TEMPLATE).save_pretrained(target)
    ids = tokenizer.convert_tokens_to_ids
    config = PaddleOCRVLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         pad_token_id=ids("<pad>"), bos_token_id=ids("<s>"), eos_token_id=ids("</s>")),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14, spatial_merge_size=2),
        image_token_id=ids("<|IMAGE_PLACEHOLDER|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|IMAGE_START|>"), vision_end_token_id=ids("<|IMAGE_END|>"))
    torch.manual_seed(0)
    PaddleOCRVLForConditionalGeneration(config).save_pretrained(target)
    return target


def save_gemma4(target: Path) -> Path:
    """Gemma 4: a 1-layer tower over 4-pixel patches pooled 3×3 to a soft token, each image resized in proportion
    within max_soft_tokens 70 (the least its image processor takes: 630 patches; a 28×28 square is 96×96 pixels, 64
    soft tokens), a 2-layer decoder whose image tokens attend both ways (use_bidirectional_attention "vision", as
    the larger models'). Its Gemma4Processor needs torchvision (videos): the folder holds the tokenizer (the image
    tokens the processor reads from it) and the PIL image processor."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil

    from tuneloop.data.chat_template_texts import GEMMA4

    specials = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|video|>",
                "<|audio>", "<audio|>", "<|audio|>"]
    tokenizer = tiny_tokenizer(specials, "<eos>", "<pad>", bos_token="<bos>", extra_special_tokens={
        "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
        "boa_token": "<|audio>", "eoa_token": "<audio|>"})
    tokenizer.chat_template = GEMMA4
    tokenizer.save_pretrained(target)
    Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3).save_pretrained(target)
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma4Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=512,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                         hidden_size_per_layer_input=0, vocab_size_per_layer_input=len(tokenizer),
                         use_bidirectional_attention="vision", pad_token_id=ids("<pad>"), eos_token_id=ids("<eos>"),
                         bos_token_id=ids("<bos>")),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                           position_embedding_size=64),
        audio_config=None, boi_token_id=ids("<|image>"), eoi_token_id=ids("<image|>"),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"), boa_token_id=ids("<|audio>"),
        eoa_token_index=ids("<audio|>"), audio_token_id=ids("<|audio|>"))
    torch.manual_seed(0)
    Gemma4ForConditionalGeneration(config).save_pretrained(target)
    return target


# model type -> the function that saves its tiny twin in a folder (LLaVA's and Qwen2-VL's: test_vision_language.py's)
TWINS = {"llava": save_llava, "qwen2_vl": save_qwen2_vl,
         "qwen2_5_vl": lambda target: save_qwen2_vl(target, version="2.5"),
         "gemma3": save_gemma3, "gemma4": save_gemma4, "idefics3": save_idefics3, "smolvlm": save_smolvlm,
         "mllama": save_mllama, "mistral3": save_mistral3, "internvl": save_internvl, "paddleocr_vl": save_paddleocr_vl,
         "qwen3_vl": save_qwen3_vl, "qwen3_vl_moe": save_qwen3_vl_moe, "qwen3_5": save_qwen3_5,
         "qwen3_5_moe": save_qwen3_5_moe, "glm4v": save_glm4v, "glm4v_moe": lambda target: save_glm4v(target, moe=True)}
