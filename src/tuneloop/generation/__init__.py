"""Where an online RL run's completions come from, behind one interface (interface.py): prompts' token ids in,
completions' token ids and the sampler's log-probs out. transformers' generate on the training weights
(transformers_engine.py) or a vLLM server the weights of every optimizer step are synced to (vllm_server.py,
weight_sync.py). The agents, distillation and benchmark-eval work reuse it."""
