"""The architectures kvsieve is checked on: those whose attention it computes exactly, and those it refuses, and why.

This is the test matrix itself (``tests/engine/test_architectures.py`` runs a tiny random model of each
``model_type``: ``full`` equals the model's eager attention over a ``DynamicCache``, prefill and decode, in a
left-padded batch, and every attention argument it passes is one kvsieve knows; a refused one raises
:class:`~kvsieve.engine.attention.UnsupportedModelError` before anything is cached), and the supported-models page
(``docs/models.md``) is rendered from it.
"""

from __future__ import annotations

EXACT: dict[str, str] = {
    "apertus": "Apertus",
    "arcee": "Arcee (AFM)",
    "cohere": "Command R (Cohere)",
    "cohere2": "Command R7B (Cohere 2)",
    "ernie4_5": "ERNIE 4.5",
    "exaone4": "EXAONE 4",
    "gemma": "Gemma",
    "gemma2": "Gemma 2 (logit soft-capping, sliding windows)",
    "gemma3_text": "Gemma 3 (sliding windows)",
    "glm": "GLM",
    "glm4": "GLM-4",
    "gpt2": "GPT-2",
    "gpt_bigcode": "GPT-BigCode (StarCoder)",
    "gpt_neox": "GPT-NeoX (Pythia)",
    "gpt_oss": "GPT-OSS (attention sinks, sliding windows)",
    "gptj": "GPT-J",
    "granite": "Granite",
    "granitemoe": "Granite MoE",
    "helium": "Helium",
    "llama": "Llama (SmolLM2, TinyLlama, ...)",
    "ministral": "Ministral",
    "mistral": "Mistral",
    "mixtral": "Mixtral",
    "nemotron": "Nemotron",
    "olmo": "OLMo",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3",
    "opt": "OPT",
    "persimmon": "Persimmon",
    "phi": "Phi-1, Phi-2",
    "phi3": "Phi-3, Phi-4",
    "phimoe": "Phi-3.5-MoE",
    "qwen2": "Qwen2, Qwen2.5 (Qwen2.5-Coder)",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "seed_oss": "Seed-OSS",
    "smollm3": "SmolLM3",
    "stablelm": "StableLM",
    "starcoder2": "StarCoder2",
}
"""``model_type`` → the models it covers: architectures whose attention kvsieve computes exactly."""

REFUSED: dict[str, tuple[str, str]] = {
    "jetmoe": ("JetMoE", "transforms the keys after the cache stores them"),
    "bloom": ("BLOOM", "ALiBi in its own attention code: it does not use transformers' attention interface"),
    "falcon_h1": ("Falcon-H1", "hybrid attention and state-space layers"),
    "qwen3_next": ("Qwen3-Next", "linear-attention layers"),
    "llama4_text": ("Llama 4", "chunked attention layers"),
}
"""``model_type`` → (the models, why kvsieve refuses them): checked to raise before anything is cached."""


def markdown() -> str:
    """The two tables of the supported-models page."""
    lines = ["| `model_type` | models | kvsieve |", "|---|---|---|"]
    lines += [f"| `{name}` | {models} | exact |" for name, models in EXACT.items()]
    lines += ["", "| `model_type` | models | kvsieve refuses it: why |", "|---|---|---|"]
    lines += [f"| `{name}` | {models} | {why} |" for name, (models, why) in REFUSED.items()]
    return "\n".join(lines) + "\n"
