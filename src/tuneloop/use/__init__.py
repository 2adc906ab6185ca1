"""Using what a run trained: `tuneloop infer` (generate.py), `tuneloop eval` (evaluate_model.py) and
`tuneloop merge-lora` (merge.py); commands.py adds them to the command line. Nothing here imports torch at
import time, so `tuneloop --help` stays instant."""
