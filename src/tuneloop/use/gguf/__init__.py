"""`tuneloop export --format gguf`: a Hugging Face model folder (or a LoRA run, merged in memory) as one GGUF file for
llama.cpp, Ollama and LM Studio. The file carries the tokenizer and the chat template the run trained with.

One concern a module: `architectures` (llama.cpp's names, metadata and tensor layout per model family), `vocab`
(the tokenizer in llama.cpp's terms), `quantize` (the tensor types of each --quant), `chat` (the turn-end token
and the Ollama Modelfile), `write` (the export itself: header, streamed tensors, atomic file).
"""
