"""The training loop and what it carries: objectives and losses, checkpoints and resumes, evaluation, metrics, and the
model it leaves behind."""
