"""A tokenizer trained on the run's own training text (`train_tokenizer:`), for a model trained from scratch.

The forum's T5 job starts here: a vocabulary learnt from the data, then a model whose embeddings are sized
to it. The `tokenizers` library trains it from the rendered rows (what the model will read: the format's
prompt and reply, a chat template's markers included), streamed, before the data is prepared. The result
is a standard fast tokenizer folder, cached in dataset_prepared_path under a key of everything that
changes it (the data files' bytes, the dataset entries, the settings), and saved with the model.

- `bpe`: byte-level BPE (GPT-2's kind): every byte is in the alphabet, so no text is ever unknown.
- `unigram`: SentencePiece's unigram model with its word-boundary marker (T5's kind).

For an encoder-decoder the tokenizer appends eos to what it encodes, as T5's does: the encoder's inputs
end with it in training and at `tuneloop infer` alike. The special tokens take the first ids in the order
given (T5's order by default: pad 0, eos 1, unk 2), and the rows of the held-out eval split are part of
the text it learns from (the split is made after tokenization).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from tuneloop.data.formats import RenderContext, render_row
from tuneloop.data.load import parse_row
from tuneloop.errors import UserError

TOKENIZER_VERSION = 2  # bump when the way a tokenizer is trained changes


def trained_tokenizer(cfg, encoder_decoder: bool):
    """The tokenizer `cfg.train_tokenizer` describes, trained on the training rows' text (once per cache key)."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(cfg.dataset_prepared_path) / f"tokenizer-{tokenizer_key(cfg, encoder_decoder)}"
    if not (folder / "tokenizer.json").exists():
        _train_into(cfg, encoder_decoder, folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def tokenizer_key(cfg, encoder_decoder: bool) -> str:
    from tuneloop.data.prepare import data_files_digest

    settings = {"version": TOKENIZER_VERSION, "train_tokenizer": cfg.train_tokenizer.model_dump(),
                "datasets": [entry.model_dump() for entry in cfg.train_entries], "encoder_decoder": encoder_decoder,
                "shard": [cfg.dataset_shard_num, cfg.dataset_shard_idx], "chat_template": cfg.chat_template,
                "chat_template_jinja": cfg.chat_template_jinja}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(data_files_digest(cfg, cfg.train_entries).encode())
    return digest.hexdigest()[:16]


def _train_into(cfg, encoder_decoder: bool, folder: Path) -> None:
    """Trains and saves into `folder` atomically (a reader sees a whole tokenizer or none)."""
    spec = cfg.train_tokenizer
    backend = _untrained(spec)
    backend.train_from_iterator(_training_texts(cfg, spec, encoder_decoder), trainer=_trainer(spec), length=None)
    wrapped = _wrapped(backend, spec, encoder_decoder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=folder.parent))
    try:
        wrapped.save_pretrained(temp)
        os.replace(temp, folder)
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)
        if not (folder / "tokenizer.json").exists():  # (another rank finishing first is fine: theirs is the same)
            raise


def _untrained(spec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    unknown = spec.special_tokens.get("unk_token")
    if spec.type == "bpe":
        backend = Tokenizer(models.BPE(unk_token=unknown))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        backend = Tokenizer(models.Unigram())
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
    return backend


def _trainer(spec):
    from tokenizers import pre_tokenizers, trainers

    special = list(dict.fromkeys(spec.special_tokens.values()))
    if spec.type == "bpe":
        return trainers.BpeTrainer(vocab_size=spec.vocab_size, min_frequency=spec.min_frequency,
                                   special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                   show_progress=False)
    return trainers.UnigramTrainer(vocab_size=spec.vocab_size, special_tokens=special,
                                   unk_token=spec.special_tokens.get("unk_token"), show_progress=False)


def _wrapped(backend, spec, encoder_decoder: bool):
    """The trained backend as a transformers tokenizer, its special tokens named."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    eos = spec.special_tokens["eos_token"]
    if encoder_decoder:
        backend.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, backend.token_to_id(eos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, **spec.special_tokens)


def _training_texts(cfg, spec, encoder_decoder: bool) -> Iterator[str]:
    """Every training row's rendered text, streamed (the same rows and renderers the preparation uses; a
    streamed run's, pretraining_dataset's included). An encoder-decoder's source and target are two texts, as
    they are tokenized: no piece spans the seam between them."""
    from tuneloop.data.chat_templates import resolve_template
    from tuneloop.data.prepare import read_jobs
    from tuneloop.data.source_target import source_and_target

    shell = _wrapped(_untrained(spec), spec, encoder_decoder=False)  # renders chat templates; encodes nothing
    shard = (cfg.dataset_shard_num, cfg.dataset_shard_idx) if cfg.dataset_shard_num else None
    entries = cfg.train_entries  # `datasets`, or pretraining_dataset's entries
    contexts = []
    for entry in entries:
        if entry.type is None:
            raise UserError(f"config: `train_tokenizer` learns from text, and the dataset {entry.path} holds token "
                            "ids (no `type`); give its text with a `type`, or a tokenizer with `tokenizer_config`")
        template = resolve_template(entry.chat_template or cfg.chat_template,
                                    entry.chat_template_jinja or cfg.chat_template_jinja, shell)
        contexts.append(RenderContext(shell, template, tuple(cfg.eot_tokens or ()),
                                      template_name=entry.chat_template or cfg.chat_template))
    for job in read_jobs(entries, None, shard):
        entry, context = entries[job.entry_index], contexts[job.entry_index]
        for raw in job.rows:
            rendered = render_row(parse_row(raw), entry, context)
            if encoder_decoder:
                yield from source_and_target(rendered)[:2]
            else:
                yield rendered.text
