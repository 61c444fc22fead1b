"""Evaluation: perplexity and policy comparisons over the engine."""
