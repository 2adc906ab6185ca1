"""The training rows: read, formatted, tokenized and masked, prepared whole or streamed, batched and collated."""
