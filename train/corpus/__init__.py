"""The offline training corpus: sources (``registry``), document access (``documents``), token shards
(``shards``), weighted mixtures (``mixture``) and the held-out overlap check (``overlap``).
CLI: ``python -m train.corpus {list,fetch,build,pack,check-overlap}``."""
