"""The papers' motivating analyses of attention on real text (``kvsieve analyze``).

Each analysis is a function of a model and a token sequence returning a dataclass with ``to_dict()``:
:mod:`~kvsieve.analysis.maps` (``sparsity``, ``powerlaw``, ``entropy``: statistics of each layer's attention map),
:mod:`~kvsieve.analysis.persistence` (``persistence``), :mod:`~kvsieve.analysis.kept` (``positions``, ``recall``:
what a policy keeps). :func:`kvsieve.analysis.report.run_analysis` runs one and writes its PNG and markdown.
This module imports nothing heavy, so that the command line's ``--help`` stays fast.
"""

from __future__ import annotations

ANALYSES: dict[str, str] = {
    "sparsity": "H2O Fig. 2a: attention mass in the top 1/5/10/20%% of keys and the share of near-zero scores",
    "powerlaw": "H2O Fig. 2b: accumulated attention per token, rank-frequency on log-log axes, power-law fit",
    "persistence": "Scissorhands §3: share of tokens heavy in the second half already heavy in the first; a map",
    "positions": "AhaKV Fig. 2: original positions each policy keeps, and accumulated attention vs position",
    "entropy": "AhaKV §3.1: attention-row entropy vs query position, with ln(i) for a uniform row",
    "recall": "attention recall/loss: full attention mass on the tokens a policy keeps, per layer and decode step",
}
"""Analysis name → one-line description (argparse help: ``%%`` is a percent sign)."""

POLICY_ANALYSES = ("positions", "recall")
"""The analyses that stream the text through the caches of ``--policies`` at ``--budget``."""

DEFAULT_POLICIES = ("h2o", "ahakv", "scissorhands", "streaming_llm")
