"""RULER-style long-context evaluation (Hsieh et al., 2024): its task families generated offline at lengths counted
with the model's tokenizer (:mod:`~kvsieve.ruler.tasks`), its scoring (:mod:`~kvsieve.ruler.scoring`), a resumable
grid of policies × compressions × protocols (:mod:`~kvsieve.ruler.run`; a sample answered under its settings:
:mod:`~kvsieve.ruler.predict`), its report (:mod:`~kvsieve.ruler.report`) and the papers' claims checked on it
(:mod:`~kvsieve.ruler.claims`).
"""
