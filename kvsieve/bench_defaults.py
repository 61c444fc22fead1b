"""The ``bench`` command's defaults, kept free of heavy imports: the command line's parser shows them without
importing torch (``kvsieve --help`` stays fast)."""

DEFAULT_POINTS = ((512, 32), (512, 512), (2048, 256), (7936, 256))
"""(prompt, generation) tokens of the grid points."""
DEFAULT_BATCHES = (1, 4, 16)
DEFAULT_POLICIES = ("local", "streaming_llm", "h2o")
DEFAULT_BUDGET = 512
