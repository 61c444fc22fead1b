"""Tests for loading a local GGUF file: converted once into the cache, then read from the copy; clear errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

import kvsieve.models
from kvsieve.cli import main
from kvsieve.models import load_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "Ġa n", "e r", "Ġ c", "a t", "Ġc at")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _tokenizer_metadata(writer: gguf.GGUFWriter) -> int:
    """A tiny byte-level BPE vocabulary (256 bytes, a few merges, three control tokens); returns its size."""
    tokens = list(bytes_to_unicode().values()) + [merge.replace(" ", "") for merge in MERGES] + list(SPECIALS)
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def _write_gguf(model: Qwen2ForCausalLM, path: Path) -> None:
    """``model`` as an F32 qwen2 GGUF, with the metadata keys and tensor names llama.cpp writes."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer_metadata(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2ForCausalLM]:
    """A tiny random qwen2 model (every weight and bias random) and the GGUF file written from it."""
    vocab_size = 256 + len(MERGES) + len(SPECIALS)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    _write_gguf(model, path)
    return path, model


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_round_trip(tiny_gguf: tuple[Path, Qwen2ForCausalLM], cache: Path) -> None:
    path, source = tiny_gguf
    model, tokenizer = load_model(str(path), device="cpu")
    assert isinstance(model, Qwen2ForCausalLM) and model.dtype == torch.float32 and not model.training
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (2, 2)
    text = "the cat and the hat"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text
    assert ids.shape[1] < len(text.encode()), "the merges must apply"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=0)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert [p.name for p in (cache / "models").iterdir()] == [f"tiny-qwen2-{digest[:16]}"]


def test_gguf_second_load_reads_the_copy(
    tiny_gguf: tuple[Path, Qwen2ForCausalLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_gguf
    first, _ = load_model(str(path), device="cpu")

    def refuse(gguf_file: Path, target: Path) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(kvsieve.models, "convert_gguf", refuse)
    second, _ = load_model(str(path), device="cpu")
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        (None, FileNotFoundError, "GGUF file {path} does not exist"),
        (b"not a model", ValueError, "{path} is not a GGUF file (it does not start with b'GGUF')"),
    ],
)
def test_bad_gguf_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, error: type, message: str
) -> None:
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error) as err:
        load_model(str(path), device="cpu")
    assert str(err.value) == message.format(path=path)
    assert main(["generate", "--model", str(path), "--device", "cpu", "Hi"]) == 2
    assert capsys.readouterr().err == f"kvsieve generate: error: {err.value}\n"
