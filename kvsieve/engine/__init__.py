"""The engine: evicting cache layers, the attention hook and budgets."""
