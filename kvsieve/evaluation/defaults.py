"""Evaluation defaults and names, free of heavy imports: sweeps, their Ray or process-pool workers and the command
line read them without importing lm-eval or ROUGE (several seconds per process)."""

DEFAULT_MODEL = "smollm2-135m"
PROTOCOLS = ("stream", "prefill")
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
QUESTION_MODES = ("aware", "agnostic")
"""When the context is compressed. ``aware``: together with the question (one prompt: the policy sees the question,
and it may evict it); ``agnostic``: before the question is known, as in kvpress's pipeline — the context alone is
compressed, then the question is fed and the answer decoded with no further eviction (``decode_budget=None``)."""
DEFAULT_QUESTION = "aware"
BUDGET_OF = ("request", "context")
"""What a ratio budget of an lm-eval request is a ratio of: the whole request (the H2O protocol), or its context."""


def check_question(question: str, protocol: str = "prefill") -> None:
    """Refuse an unknown question mode, or ``agnostic`` with a protocol other than ``prefill`` (it is a variant of
    the prefill protocol: the context compressed once)."""
    if question not in QUESTION_MODES:
        raise ValueError(f"question must be one of {', '.join(QUESTION_MODES)}, got {question!r}")
    if question == "agnostic" and protocol != "prefill":
        raise ValueError(
            f"question=agnostic compresses the context once before the question: it needs the prefill protocol, not "
            f"{protocol!r}"
        )
