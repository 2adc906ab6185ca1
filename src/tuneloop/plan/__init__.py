"""The plan of a run: every number, before training (build.py), its schedule (schedule.py), its memory per rank
(memory.py) and compute (flops.py), and its words (text.py)."""
