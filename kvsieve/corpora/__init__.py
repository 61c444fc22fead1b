"""Built-in real-text corpora: :mod:`kvsieve.corpora.wikipedia` (106 English Wikipedia articles as prose)."""
