"""``kvsieve reproduce PAPER``: each paper's analyses, grids and ablations as one resumable command, and a report
whose claims table is computed from the measured numbers.

- :mod:`~kvsieve.reproduce.claims`: the measured numbers (:class:`~kvsieve.reproduce.claims.Results`) and the
  claims, each a small predicate over them;
- :mod:`~kvsieve.reproduce.experiments`: the kinds of experiment (a sweep grid; cell experiments, with an analysis,
  rolling streams, a needle grid and kept positions in :mod:`~kvsieve.reproduce.cells`), each resumable under
  ``OUT/<experiment>/``;
- :mod:`~kvsieve.reproduce.runner`: runs a paper's plan and writes ``report.md`` and ``results.json``;
- one module per paper (:mod:`~kvsieve.reproduce.h2o`, :mod:`~kvsieve.reproduce.scissorhands`,
  :mod:`~kvsieve.reproduce.ahakv`) with ``plan(quick) -> Plan``: its experiments and claims.

This module imports nothing heavy, so that the command line's ``--help`` stays fast.
"""

from __future__ import annotations

PAPERS: dict[str, str] = {
    "h2o": "H2O (Zhang et al., NeurIPS 2023): attention sparsity and power law, heavy-hitter ablations, rolling "
    "streams, accuracy, key information at varying positions",
    "scissorhands": "Scissorhands (Liu et al., NeurIPS 2023): persistence of importance, quality at 20%, the "
    "layer-wise budget",
    "ahakv": "AhaKV (Gu et al., 2025): kept positions, attention entropy, the RA/SGS/VPE ablation in both "
    "protocols, needle retrieval, accuracy",
}
"""Paper name → one-line description."""


def default_out(paper: str, quick: bool = False) -> str:
    """``out/reproduce/PAPER``; ``out/reproduce/PAPER-quick`` for ``--quick`` (so that a quick run never replaces the
    cells of a full one: cells are keyed by task, policy and budget, and other settings mean recompute)."""
    return f"out/reproduce/{paper}{'-quick' if quick else ''}"
