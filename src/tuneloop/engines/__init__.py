"""The engines that run the model over the ranks, one module each: DDP (ddp.py), FSDP2 (fsdp2.py), DeepSpeed
ZeRO (deepspeed.py). Each holds the reading of its keys (torch-free: `check` uses it), its share of the memory
estimate, its description and its runtime; base.py is what they share and what the loop and the checkpoints
talk to; keys.py says which one a config asks for.

Every engine averages gradients over ranks, which is why the loop scales each micro-batch's summed loss by
world_size / (the step's target tokens).
"""
