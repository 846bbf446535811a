"""``eval.data.texts``: the embedded public-domain books, re-exported from ``train/corpus/texts.py``.

The loader lives in train/ because train's corpus uses it and layers import only downward (eval may
import train, not the reverse). This name stays for eval's tasks and for ``python -m eval.data.texts``.
"""

from train.corpus.texts import (  # noqa: F401  (re-exports)
    HELD_OUT_TEXT,
    TEXT_NAMES,
    TEXT_SOURCES,
    TextSource,
    cache_dir,
    load_text,
    main,
    read_r_lazyload,
    strip_gutenberg_boilerplate,
)

if __name__ == "__main__":
    main()
