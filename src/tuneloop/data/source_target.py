"""An encoder-decoder's rows: a prompt for the encoder, a target for the decoder, as one stored row.

A renderer (formats.py) marks the trained characters of a row's text; an encoder-decoder reads the text before
the first trained span as its source and the text from there to the end of the last trained span as its
target. Each side is tokenized as the tokenizer does it alone and ends with eos (T5's tokenizer adds it; the
decoder must learn to stop, the encoder is trained on inputs that end with it). The store keeps a row as its
source tokens (labels -100) followed by its target tokens, and the source's length beside it (token_store.py);
the collator splits them again (collate.Seq2SeqCollator).
"""

from __future__ import annotations

import numpy as np

from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.errors import UserError


def tokenize_source_target(rendered: list, tokenizer, encoder) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """A rendered row split where its trained text starts: the text before it is the encoder's input, the text
    from there to the end of the last trained span the decoder's target. Each side is tokenized as the
    tokenizer does it alone (T5's adds `</s>`) and ends with eos. Inside the target, the tokens the renderer did
    not mark (a user turn between two trained replies) and nothing else are masked; so is a row without any
    trained text (dropped)."""
    if not rendered:
        return []
    eos = tokenizer.eos_token_id
    sources, targets, spans = [], [], []
    for row in rendered:
        source, target, target_spans = source_and_target(row)
        sources.append(source)
        targets.append(target)
        spans.append(target_spans)
    source_encodings = encoder.encode_batch(sources, add_special_tokens=rendered[0].add_special_tokens)
    target_encodings = encoder.encode_batch(targets, add_special_tokens=True)
    results = []
    for source, target, target_spans, text in zip(source_encodings, target_encodings, spans, targets):
        source_ids = _ending_with(np.asarray(source.ids, dtype=np.int64), eos)
        target_ids = np.asarray(target.ids, dtype=np.int64)
        bounds = np.asarray(target.offsets, dtype=np.int64).reshape(-1, 2)
        starts, ends = bounds[:, 0], bounds[:, 1]
        trained = ends == starts  # what the tokenizer adds around a target (T5's `</s>`) is the decoder's to predict
        for span_start, span_end in target_spans:
            trained |= (starts < span_end) & (ends > span_start)
        if not text:
            trained[:] = False  # an empty reply: nothing to learn but an end, and the row is dropped
        labels = np.where(trained, target_ids, IGNORE_INDEX)
        if eos is not None and (not len(target_ids) or target_ids[-1] != eos):
            target_ids = np.append(target_ids, eos)
            labels = np.append(labels, eos if text else IGNORE_INDEX)
        results.append((np.concatenate([source_ids, target_ids]),
                        np.concatenate([np.full(len(source_ids), IGNORE_INDEX), labels]), len(source_ids)))
    return results


def source_and_target(row) -> tuple[str, str, list[tuple[int, int]]]:
    """A rendered row as an encoder-decoder reads it: the text before its first trained span (the source), the
    text from there to the end of its last trained span (the target), and the trained spans within the target."""
    start = row.trained_spans[0][0] if row.trained_spans else len(row.text)
    end = max((span_end for _, span_end in row.trained_spans), default=start)
    return (row.text[:start], row.text[start:end],
            [(span_start - start, span_end - start) for span_start, span_end in row.trained_spans])


def _ending_with(ids: np.ndarray, eos: int | None) -> np.ndarray:
    """The encoder's input ends with eos, as transformers' seq2seq models are trained (T5's tokenizer adds it)."""
    if eos is None or (len(ids) and ids[-1] == eos):
        return ids
    return np.append(ids, eos)


def pretokenized_pair(row, vocabulary: int, pad_token_id: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """An encoder-decoder row given as tokens, as transformers' DataCollatorForSeq2Seq takes it: `input_ids` for
    the encoder and `labels` for the decoder (-100 where not trained)."""
    input_ids, labels = row.values.get("input_ids"), row.values.get("labels")
    for name, value in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(value, list) or not all(isinstance(token, int) for token in value):
            raise UserError(f"data: {row.where}: a dataset without `type` is read as tokens; an encoder-decoder "
                            f"needs `{name}` (a list of token ids: input_ids for the encoder, labels for the "
                            f"decoder; fields present: {', '.join(sorted(row.values)) or 'none'}); or set `type`")
    outside = [token for token in input_ids + labels if token != IGNORE_INDEX and not 0 <= token < vocabulary]
    if outside:
        raise UserError(f"data: {row.where}: token id {outside[0]} is outside the tokenizer's vocabulary of "
                        f"{vocabulary} (labels may also be -100); were these rows made with another tokenizer?")
    targets = np.asarray(labels, dtype=np.int64)
    # a -100 target has no token to feed the decoder on the next position: pad's id stands in (never predicted)
    decoder_tokens = np.where(targets == IGNORE_INDEX, pad_token_id or 0, targets)
    return (np.concatenate([np.asarray(input_ids, dtype=np.int64), decoder_tokens]),
            np.concatenate([np.full(len(input_ids), IGNORE_INDEX), targets]), len(input_ids))
