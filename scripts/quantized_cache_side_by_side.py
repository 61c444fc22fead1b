"""kvsieve's quantized slots next to transformers' own ``QuantizedCache`` (optimum-quanto backend): same bits, no
eviction, the same real text — perplexity and the K/V bytes each cache holds.

Both caches are fed the text one token at a time (a quantized cache only changes what later tokens read: a one-pass
prefill would attend to exact keys in transformers' cache). Both use groups of ``--group-size`` consecutive channels
of one token (quanto's ``axis=0``, kvsieve's only layout) and keep the ``--residual`` newest tokens exact:
transformers' cache holds between 0 and ``residual`` exact tokens (it quantizes them all, with the whole cache
again, when the window fills), kvsieve's always the newest ``residual``, each token quantized once. The reference
is the unquantized full cache (the model is float32, so are its keys and values).

transformers' cache has no byte count: its layers are built with a subclass that records the bytes of the quantized
tensors it makes (their packed data, scale and shift, read through the tensor-subclass protocol
``__tensor_flatten__``), plus the exact window's tensors.

    python scripts/quantized_cache_side_by_side.py [--tokens 512] [--bits 4 2] [--group-size 32] [--residual 32]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import Cache, PreTrainedModel, QuantoQuantizedLayer

import kvsieve
from kvsieve.data import builtin_text
from kvsieve.evaluation.perplexity import stream_perplexity


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (quanto's packed codes, scale and shift)."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t.nbytes
    names, _ = t.__tensor_flatten__()
    return sum(tensor_nbytes(getattr(t, name)) for name in names)


class MeasuredQuantoLayer(QuantoQuantizedLayer):
    """transformers' quanto layer, recording the bytes of the quantized keys and values it holds (the latest two
    tensors its ``_quantize`` hook made: keys, then values)."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.made: list[int] = []

    def _quantize(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        qtensor = super()._quantize(tensor, axis)
        self.made = [*self.made[-1:], tensor_nbytes(qtensor)]
        return qtensor

    def nbytes(self) -> int:
        exact = self.keys.nbytes + self.values.nbytes if self.keys is not None else 0
        return sum(self.made) + exact


@torch.inference_mode()
def token_by_token_nll(model: PreTrainedModel, cache: Cache, ids: torch.Tensor, desc: str) -> float:
    """Mean negative log-likelihood of ``ids`` ``[1, L]`` fed one token at a time through ``cache``."""
    total = 0.0
    for t in tqdm(range(ids.shape[1] - 1), desc=desc, leave=False):
        logits = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1].float()
        total -= torch.log_softmax(logits, dim=-1)[0, ids[0, t + 1]].item()
    return total / (ids.shape[1] - 1)


def row(name: str, bits: str, nll: float, kv_bytes: int, seconds: float, tokens: int, ref: float | None) -> dict:
    ppl = math.exp(nll)
    return {
        "cache": name,
        "bits": bits,
        "ppl": ppl,
        "vs_fp32": None if ref is None else ppl / ref,
        "kv_mib": kv_bytes / 2**20,
        "bytes_per_token": kv_bytes / tokens,
        "seconds": seconds,
    }


def timed(fn: Callable[[], tuple[float, int]]) -> tuple[float, int, float]:
    start = time.perf_counter()
    nll, nbytes = fn()
    return nll, nbytes, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of one built-in Wikipedia article")
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 2], choices=[2, 4], help="(quanto: 2 or 4)")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--residual", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = kvsieve.load_model("smollm2-135m", device="cpu")
    ids = tokenizer(builtin_text(min_chars=args.tokens * 6), return_tensors="pt").input_ids[:, : args.tokens]
    layers = model.config.get_text_config().num_hidden_layers
    held = ids.shape[1] - 1  # tokens each cache holds at the end
    g, r = args.group_size, args.residual

    def ours(spec: str) -> Callable[[], tuple[float, int]]:
        def run() -> tuple[float, int]:
            result, cache = stream_perplexity(model, ids, spec, 1.0, prefill=1, progress=True)
            return result.nll, cache.kv_nbytes()

        return run

    def theirs(bits: int) -> Callable[[], tuple[float, int]]:
        def run() -> tuple[float, int]:
            model.set_attn_implementation("sdpa")
            kwargs = {"nbits": bits, "axis_key": 0, "axis_value": 0, "q_group_size": g, "residual_length": r}
            cache = Cache(layers=[MeasuredQuantoLayer(**kwargs) for _ in range(layers)])
            nll = token_by_token_nll(model, cache, ids, f"QuantizedCache {bits}-bit")
            return nll, sum(layer.nbytes() for layer in cache.layers)

        return run

    rows = []
    nll, nbytes, seconds = timed(ours("full"))
    rows.append(row("kvsieve full (fp32 K/V)", "32", nll, nbytes, seconds, held, None))
    ref = rows[0]["ppl"]
    for bits in args.bits:
        nll, nbytes, seconds = timed(theirs(bits))
        name = f"transformers QuantizedCache (quanto, g{g}, r{r})"
        rows.append(row(name, str(bits), nll, nbytes, seconds, held, ref))
        nll, nbytes, seconds = timed(ours(f"full:kv_bits={bits},group_size={g},residual={r}"))
        rows.append(row(f"kvsieve full:kv_bits={bits} (g{g}, r{r})", str(bits), nll, nbytes, seconds, held, ref))

    print(f"\nSmolLM2-135M (float32), {ids.shape[1]} tokens of Wikipedia fed one at a time, no eviction")
    print("| cache | bits | ppl | vs fp32 | KV MiB | bytes/token | s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        vs = "1" if x["vs_fp32"] is None else f"{x['vs_fp32']:.4f}"
        print(
            f"| {x['cache']} | {x['bits']} | {x['ppl']:.3f} | {vs} | {x['kv_mib']:.3f} | "
            f"{x['bytes_per_token']:.0f} | {x['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
