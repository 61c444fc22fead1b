"""Evaluation defaults and names, free of heavy imports: sweeps, their Ray or process-pool workers and the command
line read them without importing lm-eval or ROUGE (several seconds per process)."""

DEFAULT_MODEL = "smollm2-135m"
PROTOCOLS = ("stream", "prefill")
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
