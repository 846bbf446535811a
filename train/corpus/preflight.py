"""What a run will read from the token cache, checked before any work.

``train/pipeline.py`` calls :func:`check_run_inputs` as soon as the tokenizer is loaded (the wanted shards are
named by its hash), before the output folder, the exploration or any weights. Every ``data.train`` source (when
the run trains or explores) and every held-out source read from shards (``podkit:heldout-*``, the corpus
sources: ``train.data.token_windows``) must have shards for this tokenizer (``train.corpus.shards.find_shards``)
or be buildable here without a download (a local file, a ``podkit:`` source whose texts are on this machine);
a ``podkit:`` book scored as text (``podkit:emma``) must be on this machine. Otherwise:

* a token cache is given (``PODKIT_TOKEN_CACHE`` / ``data.token_cache``): the run stops with one line (exit 2):
  the sources, the tokenizer hash wanted, the hash folders found in the cache, and the ``python -m train.corpus
  pack`` command that makes them. Downloads stay off for the rest of the process (``train.corpus.network``):
  a run given a token cache never touches the network;
* no token cache: the missing texts are fetched now, before any work (as the build would fetch them later);
  a fetch that fails stops the run the same way, with the ``pack`` command to run where there is network.

A token cache set one folder too deep (``DIR/<hash>``, which holds source folders itself) is said as such.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass

DEFAULT_TOKENIZER = "podkit:smollm2-135m"
PACK_EVAL_TOKENS = 1_000_000  # python -m train.corpus pack --eval-tokens default


@dataclass(frozen=True)
class Need:
    """One source a run reads: from shards (``shards``) or as text."""

    source: str
    role: str                 # the recipe field naming it
    shards: bool = True
    config: str | None = None
    split: str = "train"
    text_field: str = "text"


def run_needs(recipe, stages, eval_sources: list[str]) -> list[Need]:
    """The sources the ``stages`` of a run read (``eval_sources``: ``train.pipeline.held_out_sources``)."""
    from train.corpus.mixture import parse_mix
    from train.data import _uses_shards

    d = recipe.data
    needs: list[Need] = []
    explores = "explore" in stages and not recipe.pod.blocks_file and recipe.train.attention != "dense"
    if "train" in stages or explores:
        needs += [Need(e.source, "data.train", config=d.train_config, split=d.train_split, text_field=d.text_field)
                  for e in parse_mix(d.train, "data.train")]
    if "eval" in stages or ("train" in stages and recipe.eval.every_steps):
        for index, source in enumerate(eval_sources):
            role = "data.eval" if index == 0 else "eval.out_of_domain"
            needs.append(Need(source, role, shards=_uses_shards(source)))
    return needs


def pack_command(recipe, eval_sources: list[str], out: str) -> str:
    """The ``python -m train.corpus pack`` command that writes every shard folder the run reads into ``out``."""
    from train.corpus.mixture import mix_to_string, parse_mix
    from train.data import _uses_shards

    d, t = recipe.data, recipe.train
    tokens = d.max_train_tokens
    if tokens is None:  # every row once: as many tokens as the steps draw on one process
        tokens = max(1, t.max_steps) * t.per_device_batch_size * t.gradient_accumulation_steps * d.context_length
    parts = ["python -m train.corpus pack"]
    if recipe.model.name_or_path != DEFAULT_TOKENIZER:
        parts += ["--tokenizer", shlex.quote(recipe.model.name_or_path)]
    parts += ["--sources", shlex.quote(mix_to_string(parse_mix(d.train, "data.train"))), "--max-tokens", str(tokens),
              "--context-length", str(d.context_length), "--eval"]
    parts += [shlex.quote(s) for s in eval_sources if _uses_shards(s)]
    eval_tokens = max(recipe.eval.max_tokens, recipe.eval.curve_max_tokens or 0)
    if eval_tokens > PACK_EVAL_TOKENS:
        parts += ["--eval-tokens", str(eval_tokens)]
    parts += ["--out", shlex.quote(out)]
    return " ".join(parts)


def _download(kind: str, name: str) -> str:
    from train.corpus import registry
    from train.corpus.texts import TEXT_SOURCES

    if kind == "corpus":
        return registry.fetch_command(registry.SOURCES[name])
    return f"apt-get download {TEXT_SOURCES[name].package}"


def _found(cache, identity: dict) -> str:
    from train.corpus.shards import hash_folders

    folders = hash_folders(cache)
    if not folders:
        return "nothing" if cache.is_dir() else "nothing (the folder does not exist)"
    described = []
    for name, info in folders.items():
        there = info["tokenizer"]
        differs = [f"{key} {there.get(key)} there, {identity[key]} here" for key in ("vocab_size", "eos_token_id")
                   if key in there and there.get(key) != identity[key]]
        if name == identity["hash"][:16]:
            differs = ["this tokenizer's"]
        elif not differs and there.get("identity_version") != identity["identity_version"]:
            differs = ["an older identity"]
        described.append(f"{name} ({info['sources']} source(s){': ' + ', '.join(differs) if differs else ''})")
    return ", ".join(described)


def _listed(items: list[str], limit: int = 3) -> str:
    head = ", ".join(items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_run_inputs(recipe, stages, tokenizer, eval_sources: list[str], *, log=print) -> None:
    """Stop the run now (:class:`train.corpus.network.StopRun`, one line, exit 2) when a source it reads would
    need a download that cannot happen; see the module docstring."""
    from train.corpus import network
    from train.corpus.documents import required_texts, text_present
    from train.corpus.shards import find_shards, hash_folder_problem, token_cache_dir, tokenizer_identity

    d = recipe.data
    env = os.environ.get("PODKIT_TOKEN_CACHE") or None
    label = f"data.token_cache={d.token_cache}" if d.token_cache else (f"PODKIT_TOKEN_CACHE={env}" if env else None)
    cache = token_cache_dir(d.token_cache)
    network.forbid_downloads(f"{label} is set, and a run given a token cache never downloads" if label else None)
    if label is not None:
        deep = hash_folder_problem(cache, label)
        if deep is not None:
            raise network.stop(deep)

    identity = tokenizer_identity(tokenizer)
    missing: list[tuple[Need, str, list[tuple[str, str]]]] = []  # (need, why no shards, texts to download)
    for need in run_needs(recipe, stages, eval_sources):
        problem = "read as text"
        if need.shards:
            folder, problem = find_shards(need.source, tokenizer, cache=cache, config=need.config, split=need.split,
                                          text_field=need.text_field, identity=identity)
            if folder is not None:
                continue
        texts = required_texts(need.source)
        if texts is None:  # a local file (built here) or a Hub dataset (datasets' own cache and offline mode)
            continue
        absent = [text for text in texts if not text_present(*text)]
        if absent:
            missing.append((need, problem, absent))
    if not missing:
        return

    downloads = list(dict.fromkeys(_download(*text) for _, _, absent in missing for text in absent))
    sources = list(dict.fromkeys(f"{need.role} {need.source}" for need, _, _ in missing))
    shard_sources = [need for need, _, _ in missing if need.shards]
    if label is not None:
        where = f"in {label}" + (f" (found there: {_found(cache, identity)})" if shard_sources else "")
        raise network.stop(
            f"{_listed(sources)} {'has' if len(sources) == 1 else 'have'} no token shards for this tokenizer "
            f"(hash {identity['hash'][:16]}) {where}, and building them needs {_listed(downloads)}, which a run "
            f"given a token cache never runs; make them with: {pack_command(recipe, eval_sources, str(cache))}")
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return  # the host's first process fetches; the build waits for it (train.data.training_rows)
    from train.corpus import registry
    from train.corpus.texts import load_text

    texts = list(dict.fromkeys(text for _, _, absent in missing for text in absent))
    log(f"[corpus] fetching {len(texts)} text(s) before the run ({_listed(sources)} need(s) them): "
        + _listed(downloads))
    for kind, name in texts:
        try:
            registry.materialise(name, log=log) if kind == "corpus" else load_text(name)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
            reason = str(error).strip().splitlines()[-1].strip() if str(error).strip() else type(error).__name__
            raise network.stop(
                f"{_listed(sources)} {'has' if len(sources) == 1 else 'have'} no token shards for this tokenizer "
                f"(hash {identity['hash'][:16]}) in {cache} (found there: {_found(cache, identity)}), and "
                f"{_download(kind, name)} failed ({reason[-300:]}); where there is network, run "
                f"{pack_command(recipe, eval_sources, 'DIR')}, copy DIR here and set PODKIT_TOKEN_CACHE=DIR") from None
