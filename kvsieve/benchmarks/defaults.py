"""The ``bench`` command's defaults and preset names, free of heavy imports: the command line's parser shows them
without importing torch (``kvsieve --help`` stays fast)."""

DEFAULT_POINTS = ((512, 32), (512, 512), (2048, 256), (7936, 256))
"""(prompt, generation) tokens of the grid points."""
DEFAULT_BATCHES = (1, 4, 16)
DEFAULT_POLICIES = ("local", "streaming_llm", "h2o")
DEFAULT_BUDGET = 512
DEFAULT_REPEATS = 3
"""Rounds per grid point."""
EVICTION_OVERHEAD = "eviction-overhead"
"""The preset of :mod:`kvsieve.benchmarks.eviction_overhead`: fixed cells at budget 512 and the checks of what
eviction costs against the floor and saves against the full cache."""
STREAM_ENGINE = "stream-engine"
"""The preset of :mod:`kvsieve.benchmarks.stream_engine`: the whole-sequence engine vs one forward per token."""
PRESETS = (EVICTION_OVERHEAD, STREAM_ENGINE)
