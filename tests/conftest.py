"""Shared fixtures: tiny random models (Llama MHA/GQA, Gemma 3 with sliding layers) in any dtype, the real default
model and its tokenizer, real text. Nothing may reach the Hugging Face Hub: offline mode is set before transformers
is imported. A test that loads the real model is marked ``slow``."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# The suite runs on a few shared CPU cores: a second OpenMP thread that waits for a busy core makes tiny matmuls
# and the real model several times slower. Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import (
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import Cache

import kvsieve
from kvsieve.models import ensure_model
from kvsieve.policies import Asking

pytest.register_assert_rewrite("policy_runs")  # the shared reference checks keep pytest's assertion messages

TINY_VOCAB = 128
GEMMA_WINDOW = 8


def _llama_config(kv_heads: int, vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _gemma3_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=1,
        max_position_embeddings=1024,
        sliding_window=GEMMA_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )


def build_tiny(name: str, vocab: int = TINY_VOCAB) -> PreTrainedModel:
    """A seeded fp32 random model in eval mode using the ``"kvsieve"`` attention implementation."""
    kvsieve.register()
    torch.manual_seed(0)
    if name == "gemma3":
        model = Gemma3ForCausalLM._from_config(_gemma3_config(), attn_implementation=kvsieve.ATTN_IMPLEMENTATION)
    else:
        config = _llama_config(4 if name == "llama_mha" else 2, vocab)
        model = LlamaForCausalLM._from_config(config, attn_implementation=kvsieve.ATTN_IMPLEMENTATION)
    with torch.no_grad():  # norm weights start constant; trained ones are not (e.g. key norms then differ)
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param), alpha=0.3)
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_factory() -> Callable[..., PreTrainedModel]:
    """``build_tiny`` as a fixture (for tiny models with another vocabulary)."""
    return build_tiny


@pytest.fixture(scope="session")
def llama_mha() -> PreTrainedModel:
    """Tiny Llama, 4 query / 4 KV heads, 3 layers."""
    return build_tiny("llama_mha")


@pytest.fixture(scope="session")
def llama_gqa() -> PreTrainedModel:
    """Tiny Llama, 4 query / 2 KV heads, 3 layers."""
    return build_tiny("llama_gqa")


@pytest.fixture(scope="session")
def gemma3() -> PreTrainedModel:
    """Tiny Gemma 3: sliding (window 8) and full layers alternating, 1 KV head."""
    return build_tiny("gemma3")


@pytest.fixture(scope="session")
def tiny_models(llama_mha, llama_gqa, gemma3) -> Callable[[str, torch.dtype], PreTrainedModel]:
    """``(name, dtype) -> model``: a tiny model in ``dtype``, converted from the fp32 one once per session.

    Shared like the fp32 fixtures: a test that changes a model (its attention implementation, its config) changes a
    copy of its own.
    """
    base = {"llama_mha": llama_mha, "llama_gqa": llama_gqa, "gemma3": gemma3}
    made: dict[tuple[str, torch.dtype], PreTrainedModel] = {}

    def get(name: str, dtype: torch.dtype) -> PreTrainedModel:
        if (name, dtype) not in made:
            made[name, dtype] = base[name] if dtype == torch.float32 else copy.deepcopy(base[name]).to(dtype)
        return made[name, dtype]

    return get


@pytest.fixture(scope="session")
def real_model() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The default model (SmolLM2-135M, fp32, CPU) and its tokenizer (a test using it is marked ``slow``)."""
    return kvsieve.load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer (it has a pad token: the same as ``load_model`` gives), without the model."""
    return AutoTokenizer.from_pretrained(ensure_model("smollm2-135m"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_factory, tokenizer) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A tiny random Llama (GQA) with the real tokenizer's vocabulary, and that tokenizer."""
    return tiny_factory("llama_gqa", vocab=len(tokenizer)), tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tiny_lm, tmp_path_factory) -> str:
    """:func:`tiny_lm` saved as a model directory (what ``--model`` takes). Its config names sdpa, an attention
    implementation every process has (the model in memory may have been switched to kvsieve's)."""
    model, tokenizer = tiny_lm
    path = tmp_path_factory.mktemp("tiny") / "model"
    switched, model.config._attn_implementation = model.config._attn_implementation, "sdpa"
    try:
        model.save_pretrained(path)
    finally:
        model.config._attn_implementation = switched
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: the command must stop before."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvsieve.models.load_model", refuse)


@pytest.fixture(scope="session")
def wiki_text() -> str:
    """A real Wikipedia article of at least 20 000 characters."""
    from kvsieve.data import builtin_text

    return builtin_text(min_chars=20000)


ASKING = Asking(encode=lambda text: [3 + len(text) % 50, 4, 5], turn_end=[6, 7])
"""How the tests ask a tiny model about a context (for a policy's probes): a request as three made-up tokens (which
depend on its text), a turn's end as two."""


def is_probed(cache: Cache) -> bool:
    """Whether ``cache`` is a kvsieve cache whose policy scores its prompt by probes."""
    return isinstance(cache, kvsieve.SieveCache) and any(cls.probed for cls, *_ in cache.plan.layer_policies)


def decode_positions(cache: Cache, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The position ids of a decode step after :func:`kvsieve.compress_context`, which places each row's tokens by
    its attention mask (as ``generate`` does); None otherwise (by the tokens seen, padding included: the same
    relative positions)."""
    return None if mask is None or not is_probed(cache) else mask.sum(dim=-1, keepdim=True) - 1


def _stream(
    model: PreTrainedModel,
    cache: Cache,
    prompt: torch.Tensor,
    steps: int,
    *,
    attention_mask: torch.Tensor | None = None,
    on_step: Callable[[], None] | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Prefill ``prompt`` ``[B, L]`` then feed ``steps`` seeded random tokens one at a time through ``cache``.

    Returns the logits of every position ``[B, L + steps, V]`` (fp32); ``on_step`` runs after the prefill and after
    every decode step.
    """
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    mask = attention_mask
    outputs = []
    ids = prompt
    with torch.inference_mode():
        for step in range(steps + 1):
            if step == 0 and is_probed(cache):  # (a policy scored by probes fills its cache through them)
                logits = kvsieve.compress_context(model, cache, ids, ASKING, mask, logits_to_keep=0)
            else:
                logits = model(ids, attention_mask=mask, position_ids=decode_positions(cache, mask), cache=cache).logits
            outputs.append(logits.float())
            if on_step is not None:
                on_step()
            ids = torch.randint(3, vocab, (prompt.shape[0], 1), generator=gen)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(prompt.shape[0], 1)], dim=1)
    return torch.cat(outputs, dim=1)


@pytest.fixture(scope="session")
def stream() -> Callable[..., torch.Tensor]:
    """The prefill + random-decode loop (see ``_stream``)."""
    return _stream


def random_ids(batch: int, length: int, seed: int = 1, vocab: int = TINY_VOCAB) -> torch.Tensor:
    """Seeded random token ids (avoiding the special ids 0-2)."""
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def make_ids() -> Callable[..., torch.Tensor]:
    """``random_ids`` as a fixture."""
    return random_ids


@pytest.fixture
def model_and_venv(tmp_path: Path) -> Path:
    """What the kvpress side-by-side scripts check before they run: a model directory (``model/config.json``, 2,304
    positions) and a ready kvpress virtualenv (``venv``), under ``tmp_path``."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 2304}))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    (tmp_path / "venv" / ".installed").touch()
    return tmp_path
