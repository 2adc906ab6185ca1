"""The model's hot paths, rewritten for training: norms, MLPs, attention per packed sequence, and the output head
that losses meet in chunks."""
