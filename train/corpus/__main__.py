"""``python -m train.corpus``: fetch corpus sources, tokenise them into shards, pack shards for another machine.

    python -m train.corpus list
    python -m train.corpus fetch [NAME ...]                      # download + extract (default: all)
    python -m train.corpus build --tokenizer podkit:smollm2-135m --sources "podkit:gcide=3,podkit:austen=1"
    python -m train.corpus pack --tokenizer podkit:smollm2-135m --sources "..." --max-tokens 16000000 \\
        --context-length 2048 --out /tmp/podkit_tokens [--eval podkit:heldout-indomain podkit:heldout-ood]
    python -m train.corpus check-overlap --tokenizer podkit:smollm2-135m --sources "..." \\
        [--heldout podkit:heldout-indomain podkit:heldout-ood] [--n 32]

``pack`` writes a token cache of its own holding, per source, the tokens a run of ``--max-tokens``
training tokens draws (by the mixture's weights, plus ``--margin``), and the held-out sets in full
(at most ``--eval-tokens`` each). Copy that folder to the training machine and point the run at it
with ``PODKIT_TOKEN_CACHE=DIR`` or the recipe field ``data.token_cache: DIR`` (``DIR`` itself, not the
``DIR/<tokenizer hash>`` folder inside it). The shards are read under another transformers version too
(``train.corpus.shards``: the hash covers what decides the ids). A run that lacks some of them stops before any
work and prints the ``pack`` command that makes them (``train.corpus.preflight``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == "podkit:smollm2-135m":
        from sparse_models.smollm2 import default_model_path

        name = str(default_model_path())
    return AutoTokenizer.from_pretrained(name)


def source_listing() -> list[str]:
    """Every source ``podkit:<name>`` the documents registry resolves (``documents.podkit_names()``), grouped:
    training sources (the embedded Austen novels, the package sources, the derived recall sources), held-out
    sets, held-out splits and the single embedded books."""
    from train.corpus import documents, registry
    from train.corpus.recall import PROSE_SOURCES
    from train.corpus.texts import HELD_OUT_TEXT, TEXT_SOURCES

    def row(name: str, origin: str, size: str, licence: str) -> str:
        return f"  {documents.PREFIX + name:26s} {origin:32s} {size:30s} {licence}".rstrip()

    austen = TEXT_SOURCES[HELD_OUT_TEXT].package
    lines = ["training sources (data.train):",
             row("austen", f"deb:{austen}", f"{len(documents._austen_training_books())} novels",
                 f"public domain; {HELD_OUT_TEXT} held out")]
    for source in registry.SOURCES.values():
        meta = registry.source_folder(source.name) / "source.json"
        size = ""
        if meta.is_file():
            info = json.loads(meta.read_text())
            size = f"{info['documents']:>6} docs {info['characters'] / 1e6:7.1f}M chars"
        lines.append(row(source.name, f"{source.origin}:{source.package}", size, source.licence))
    sizes = {documents.RECALL: "recall episodes, ~0.6-1.8K tokens",
             documents.RECALL_LONG: "one episode of ~3.5-6.5K tokens/row"}
    for name in documents.RECALL_NAMES:
        lines.append(row(name, "derived (train.corpus.recall)", sizes[name],
                         "as its sources: " + ", ".join(documents.PREFIX + n for n in PROSE_SOURCES)))
    lines += ["held-out sets (data.eval, eval.out_of_domain):",
              row("heldout-indomain", "emma + each source's held-out", "", "as the sources"),
              row("heldout-ood", "books: " + ",".join(registry.OOD_BOOKS), "never in a training source", "")]
    splits = [documents.PREFIX + documents.HELDOUT_PREFIX + n for n in ("austen",) + tuple(registry.SOURCES)]
    lines += [f"held-out split of one source ({documents.PREFIX}{documents.HELDOUT_PREFIX}austen is "
              f"{HELD_OUT_TEXT}): " + ", ".join(splits)]
    lines += ["single embedded books (train.corpus.texts): "
              + ", ".join(documents.PREFIX + b for b in documents.book_names())]
    return lines


def _mix(value: str):
    from train.corpus.mixture import MixError, parse_mix

    try:
        return parse_mix(value, "--sources")
    except MixError as error:
        sys.exit(f"error: {error}")


def main(argv: list[str] | None = None) -> int:
    from train.corpus import registry

    parser = argparse.ArgumentParser(prog="python -m train.corpus", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the corpus sources, their licences and cached sizes")
    fetch = sub.add_parser("fetch", help="download and extract corpus sources")
    fetch.add_argument("names", nargs="*", help=f"default: all of {', '.join(registry.SOURCES)}")
    for name in ("build", "pack", "check-overlap"):
        p = sub.add_parser(name)
        p.add_argument("--tokenizer", default="podkit:smollm2-135m", help="podkit:smollm2-135m, a folder or a Hub id")
        p.add_argument("--sources", required=True, help="mixture: 'source=weight,source=weight' (see train.corpus.mixture)")
        p.add_argument("--cache", default=None, help="token cache (default: $PODKIT_TOKEN_CACHE or $PODKIT_CACHE/tokens)")
    pack = sub.choices["pack"]
    pack.add_argument("--max-tokens", type=int, required=True, help="training tokens the run will draw")
    pack.add_argument("--context-length", type=int, required=True)
    pack.add_argument("--margin", type=float, default=1.05, help="extra tokens per source, as a factor")
    pack.add_argument("--eval", nargs="*", default=["podkit:heldout-indomain", "podkit:heldout-ood"])
    pack.add_argument("--eval-tokens", type=int, default=1_000_000)
    pack.add_argument("--out", required=True)
    check = sub.choices["check-overlap"]
    check.add_argument("--heldout", nargs="*", default=["podkit:heldout-indomain", "podkit:heldout-ood"])
    check.add_argument("--n", type=int, default=32, help="n-gram length in tokens")
    args = parser.parse_args(argv)

    if args.command == "list":
        print("\n".join(source_listing()))
        return 0
    if args.command == "fetch":
        for name in args.names or registry.SOURCES:
            registry.materialise(name)
        return 0

    from train.corpus.shards import ensure_shards, pack_folder, token_cache_dir

    mix = _mix(args.sources)
    tokenizer = load_tokenizer(args.tokenizer)
    shards = [ensure_shards(e.source, tokenizer, cache=args.cache) for e in mix]
    if args.command == "build":
        for entry, s in zip(mix, shards):
            print(f"{entry.source:32s} weight {entry.weight:<6g} {s.total_tokens:>12,d} tokens "
                  f"{s.manifest['documents']:>8,d} docs  {s.folder}")
        print(f"total {sum(s.total_tokens for s in shards):,d} tokens")
        return 0
    if args.command == "pack":
        from train.corpus.documents import row_aligned
        from train.corpus.mixture import document_rows, plan_rows

        out = Path(args.out).expanduser()
        length = args.context_length
        # a row-aligned source's rows start at its documents (train.corpus.mixture.MixedRows)
        starts = [document_rows(s.doc_starts(), s.total_tokens, length) if row_aligned(e.source) else None
                  for e, s in zip(mix, shards)]
        plan = plan_rows([max(1, s.total_tokens // length if rows is None else len(rows))
                          for s, rows in zip(shards, starts)], [e.weight for e in mix],
                         max(1, args.max_tokens // length), seed=0)
        report = []
        for entry, s, count, rows in zip(mix, shards, plan.counts, starts):
            if rows is None or not len(rows):
                want = int(count * length * args.margin) + length
            else:  # through the end of the last row the margin asks for
                want = int(rows[min(len(rows) - 1, int(count * args.margin))]) + length
            folder = pack_folder(s, want, out)
            report.append({"source": entry.source, "weight": entry.weight, "tokens": min(want, s.total_tokens),
                           "of": s.total_tokens, "folder": str(folder.relative_to(out))})
        for source in args.eval or []:
            s = ensure_shards(source, tokenizer, cache=args.cache)
            folder = pack_folder(s, args.eval_tokens, out)
            report.append({"source": source, "eval": True, "tokens": min(args.eval_tokens, s.total_tokens),
                           "of": s.total_tokens, "folder": str(folder.relative_to(out))})
        (out / "pack.json").write_text(json.dumps({"sources": args.sources, "max_tokens": args.max_tokens,
                                                   "context_length": length, "items": report}, indent=2) + "\n")
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        for item in report:
            print(f"{item['source']:32s} {item['tokens']:>12,d} of {item['of']:>12,d} tokens")
        print(f"packed {size / 2**20:.1f} MiB into {out} (from {token_cache_dir(args.cache)}); "
              f"use it with PODKIT_TOKEN_CACHE={out} or data.token_cache: {out}")
        return 0
    # check-overlap
    from train.corpus.overlap import overlap_count

    failures = 0
    for held in args.heldout:
        tokens = ensure_shards(held, tokenizer, cache=args.cache)
        held_tokens = tokens.read(0, tokens.total_tokens)
        for entry, s in zip(mix, shards):
            hits = overlap_count(s, held_tokens, args.n)
            failures += hits > 0
            print(f"{entry.source:32s} vs {held:26s}: {hits} shared {args.n}-token windows")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
