"""Position rolling: re-rotate cached keys by their rank in the cache instead of their original position.

StreamingLLM and the H2O streaming experiment assign positions *within the cache* so that a stream can run far
past the model's ``max_position_embeddings``: the k-th oldest kept token is at position k and the query at the
position after the newest kept one. The model has already rotated keys and queries with RoPE at their true
positions ``p``; the engine stores keys un-rotated (``R(-p)·k``) and, at each step, rotates every slot by its rank
and each query by ``rank − p``. Only relative angles enter ``q·k``, so this is exact for any RoPE whose rotation
is ``x·cos θ + rotate_half(x)·sin θ`` with ``θ = pos · inv_freq`` (default, linear, llama3, … scalings).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvsieve.engine.attention import UnsupportedModelError


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary:
    """RoPE rotations by arbitrary (per-element) positions, with the model's frequencies."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.float()

    @classmethod
    def from_config(cls, config: PretrainedConfig, layer_type: str | None = None) -> Rotary:
        """The frequencies of a model with one RoPE for all layers, or (``layer_type``) of its layers of that type
        where each type has its own (Gemma 3); raises for anything else."""
        params = getattr(config, "rope_parameters", None) or {}
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        if not isinstance(rope_type, str) or "rope_theta" not in params:
            raise UnsupportedModelError(
                "kvsieve re-rotates keys and queries of a model with one rotary embedding for all layers (position "
                f"rolling) or for each layer type (expected_attention); this config's rope_parameters: {params}"
            )
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(
                "kvsieve does not re-rotate partial rotary embeddings (position rolling, expected_attention)"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
        else:
            raise UnsupportedModelError(
                f"kvsieve does not re-rotate rope_type {rope_type!r} (position rolling, expected_attention)"
            )
        return cls(inv_freq)

    def rotate(self, x: torch.Tensor, angle_pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, H, n, D]`` by positions ``angle_pos`` (``[B, H, n]`` or ``[B, 1, n]``, may be
        negative or fractional)."""
        freqs = angle_pos.to(torch.float32)[..., None] * self.inv_freq.to(x.device)
        return _turned(x, freqs.cos(), freqs.sin())

    def averaged(self, x: torch.Tensor, first: torch.Tensor, count: int) -> torch.Tensor:
        """``x`` ``[B, ..., D]`` (its last dimension a vector, each row ``b`` its own) times the mean of the rotations
        at the ``count`` positions ``first[b], first[b] + 1, …``: the rotation's form with the means of their cosines
        and sines, in closed form (a sum over an arithmetic progression of angles ``p·ω``: the mean of ``cos`` is
        ``sin(count·ω/2) / (count·sin(ω/2)) · cos((first + (count - 1)/2)·ω)``, of ``sin`` the same with ``sin``)."""
        freq = self.inv_freq.to(x.device)
        centre = (first.to(torch.float32)[:, None] + (count - 1) / 2) * freq  # [B, D/2]
        spread = torch.sin(count * freq / 2) / (count * torch.sin(freq / 2))  # (ω ≤ 1 in RoPE: sin(ω/2) > 0)
        shape = (x.shape[0], *([1] * (x.dim() - 2)), -1)
        return _turned(x, (spread * centre.cos()).view(shape), (spread * centre.sin()).view(shape))


def _turned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin``, ``cos`` and ``sin`` given per frequency (half the last dimension)."""
    cos, sin = torch.cat((cos, cos), dim=-1).to(x.dtype), torch.cat((sin, sin), dim=-1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def ranks(pos: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]`` rank of each slot among the valid slots of its (row, head) by original position (0 = oldest);
    empty slots (-1) get rank 0."""
    key = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max)
    order = key.argsort(dim=-1)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(pos.shape[-1], device=pos.device).expand_as(order))
    return rank.masked_fill(pos < 0, 0)
