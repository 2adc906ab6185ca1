"""Quantized weights in training: QAT's fake quantization, gpt-oss's MXFP4 checkpoints unpacked, and a MoE model's
expert weights in 4-bit."""
