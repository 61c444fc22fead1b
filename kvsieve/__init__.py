"""kvsieve: bounded KV caches for Hugging Face causal language models.

model, tokenizer = kvsieve.load_model()                 # SmolLM2-135M-Instruct, offline after `kvsieve data`
out = kvsieve.generate(model, tokenizer, "Once upon a time", policy="h2o", budget=0.2, max_new_tokens=64)
cache = kvsieve.make_cache(model, "streaming_llm", 256, sink=4)   # for model.generate / forward loops
"""

from kvsieve.api import Generation, generate, make_cache
from kvsieve.engine.attention import ATTN_IMPLEMENTATION, UnsupportedModelError, register
from kvsieve.engine.cache import SieveCache
from kvsieve.models import load_model
from kvsieve.policies import REGISTRY as POLICIES

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "POLICIES",
    "Generation",
    "SieveCache",
    "UnsupportedModelError",
    "generate",
    "load_model",
    "make_cache",
]
