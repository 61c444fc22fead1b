"""``ahakv``: accumulated attention made position-unbiased (recent rows, step-gain softmax) and value-aware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvsieve.engine.rules import Pattern, ScoreRule, step_gain
from kvsieve.policies.base import Observation, Slots, accumulate, in_position_order, register
from kvsieve.policies.families import ScorePolicy, scaled_probs


@dataclass(frozen=True)
class AhaKVParams:
    recent: int | None = None
    """Recent budget ``B_r`` — always kept, and the number of last prompt rows RA accumulates; default
    ``min(32, max(1, budget // 2))`` (the paper: 32)."""
    ra: bool = True
    """Recent Accumulation: prompt scores sum only the last ``recent`` query rows (off: every row, as H2O)."""
    sgs: bool = True
    """Step-gain softmax for the scores (off: the model's own attention probabilities)."""
    sgs_tokens: Literal["seen", "kept"] = "seen"
    """The ``i`` of SGS's gain: the tokens the row has ``seen`` (its position + 1, the paper's sequence length) or
    the tokens ``kept`` in its softmax (at most ``B + 1`` once the cache is full)."""
    sgs_decode: bool = True
    """SGS at decode steps too (off: decode steps add the model's own probabilities, SGS scores the prompt only)."""
    vpe: bool = True
    """Value prior: prompt scores multiplied by the normalised, pooled squared norms of the values (off: × 1)."""
    kernel: int = 5
    """Odd window of the value prior's average pooling (our choice; the paper does not state it)."""


def step_gain_probs(obs: Observation, budget: int, tokens: str = "seen") -> torch.Tensor:
    """``[B, H, b, N]`` SG-softmax of each row, the group's query heads summed (padding rows zero); ``i`` is the
    number of tokens the row has ``seen`` (its position + 1) or the number ``kept`` in its softmax (see
    :class:`AhaKVParams`)."""
    # [B, 1, b] with its own token, or [B, H, b]
    count = (obs.query_pos + 1)[:, None] if tokens == "seen" else obs.allowed.sum(dim=-1)
    return scaled_probs(obs, step_gain(count.float(), budget))


def value_prior(slots: Slots, kernel: int) -> torch.Tensor:
    """``[B, H, N]`` γ̄: per (row, head), ``ν = ||V||²`` average-pooled over the real tokens in position order (a
    centred window of ``kernel`` tokens, truncated at the ends), divided by its maximum; 0 for empty slots."""
    real = (slots.pos >= 0).float()

    def pooled(nu: torch.Tensor, count: torch.Tensor) -> torch.Tensor:  # (empty slots first, then by position)
        shape = nu.shape
        pool = [F.avg_pool1d(t.reshape(-1, 1, shape[-1]), kernel, 1, kernel // 2).reshape(shape) for t in (nu, count)]
        return pool[0] / pool[1].clamp(min=1e-6) * count

    gamma = in_position_order(slots.pos, pooled, slots.values.float().square().sum(dim=-1) * real, real)
    return gamma / gamma.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(gamma.dtype).tiny)


@register
class AhaKV(ScorePolicy):
    """AhaKV: adaptive holistic attention — unbiased accumulated attention plus a value prior.

    Gu et al., "AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of Large
    Language Models", 2025 (arXiv:2506.03762). Budget ``B = B_r + B_s``; after every step that leaves more than
    ``B`` tokens, keep the last ``B_r`` tokens and the ``B_s`` best-scored others (TopK(F, B_s) ∪ last B_r). Per
    (batch row, KV head), the score ``F`` of a token is:

    - prompt (a step of several query rows): the sum of its SG-softmax attention over the step's last ``B_r`` rows
      only (**RA**, Recent Accumulation — every token of the prompt outside the window gets the same number of
      terms, which removes H2O's bias towards early tokens), times the value prior ``γ̄`` (**VPE**). Rows are
      selected by position (``query_pos > last - B_r``), so a prompt scored in several row blocks is handled.
      Eq. 5 writes the sum over ``i = n - r .. n``; we read it as the last ``r = B_r`` rows (the rows of the
      recent window, whose tokens are kept anyway), not ``r + 1``;
    - decode: ``F_t = SGsoftmax(A_t) + F_{t-1}`` over the kept tokens.

    **SGS** (step-gain softmax). A row that has seen ``i`` tokens scores them with ``softmax(λ q·k)``,
    ``λ = sqrt(2 ln(i/k) / d)`` (``k = B``, ``d`` = head dim), i.e. the model's scaled logits ``q·k/sqrt(d)`` times
    ``sqrt(2 ln(i/k))``. Derivation: with ``q·k ~ N(0, d)`` the logits ``λ q·k`` are i.i.d. ``N(0, σ²)``,
    ``σ² = λ²d``, and the softmax over ``i`` of them has expected entropy ``E[H] ≈ ln i + σ²/2 - σ² = ln i - λ²d/2``
    (``E ln Σe^x ≈ ln(i e^{σ²/2})``, ``E Σ p x ≈ σ²``); asking ``E[H] = ln k`` — attention spread over about ``k``
    tokens whatever the length — gives the ``λ`` above. For ``i <= k`` no real ``λ`` exists (the target entropy
    is at least the maximum ``ln i``); we take the limit ``λ = 0``: the uniform distribution ``1/i``. Only the
    scores use SGS; the model's attention output is exact.

    **VPE** (value prior). ``ν_j = ||V_j||²``, ``γ = AvgPool1d(ν)`` over the (row, head)'s tokens in position
    order (window ``kernel`` centred on the token, truncated at the ends: the mean over the tokens it covers),
    ``γ̄ = γ / max γ``; applied to the contributions of multi-row steps (a prompt, or each chunk of a chunked
    prompt), over the slots held at that step.

    Readings where the paper leaves room (parameters, all measured in ``kvsieve reproduce ahakv``):

    - ``sgs_tokens``: the derivation assumes the row's softmax runs over all ``i`` tokens of the sequence; once
      the cache is compressed it runs over at most ``B + 1``. Default ``"seen"`` (``i`` = the row's position + 1,
      the paper's sequence length ``i``); ``"kept"`` counts the tokens in the softmax, which makes ``λ`` ≈ 0 at
      every decode step (``i = B + 1``): nearly uniform scores, so the oldest kept tokens accumulate most.
    - ``sgs_decode``: Alg. 1 accumulates SG-softmax scores at decode steps too (default ``True``); ``False``
      applies SGS to the prompt only. The paper evaluates long prompts compressed once, followed by short answers,
      where the two hardly differ.

    Default: the reading closest to the paper's text (``seen``, SGS at decode). Measured on SmolLM2-135M (2,048
    Wikipedia tokens, stream protocol, budget 10 % / 20 %; full 19.57): ahakv 24.95 / 21.62, ``sgs_tokens=kept``
    28.09 / 24.76, ``sgs_decode=False`` 20.81 / 20.05, h2o 20.34 / 19.69. In the prefill protocol (the first
    1,365 tokens compressed once, the other 682 scored; full 22.29) every reading gives 22.53 / 22.46, h2o 22.58 /
    22.40: SGS at decode steps is where AhaKV loses to H2O, a case the paper's protocol (long prompts compressed
    once, short answers) barely exercises.

    Ablations: ``ra=False`` accumulates every prompt row; ``sgs=False`` uses the plain probabilities;
    ``vpe=False`` sets ``γ̄ = 1``. Choices: a GQA group's query heads are scored separately (SG-softmax per head)
    and summed, as H2O does; padding queries add nothing. The priorities are the
    :class:`~kvsieve.engine.rules.ScoreRule` of the family (``score_rule``, in torch by
    :class:`~kvsieve.policies.families.ScorePolicy`); the prompt's rows (RA, VPE) are this policy's own ``observe``.
    In a stream every step is one query (no value prior; RA counts it): the rule, with SGS's multiplier of the
    logits, is then the whole policy (``scan_rule``; not with ``sgs_tokens="kept"``), and on CPU the compiled loops
    run it, with the same decisions.
    """

    name = "ahakv"
    paper = "Gu et al., AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction, 2025 (arXiv:2506.03762)"
    reads_kv = True  # the value prior, normalised over all the slots held at the step
    Params = AhaKVParams

    def setup(self) -> None:
        p = self.params
        recent = min(32, max(1, self.budget // 2)) if p.recent is None else p.recent
        if not 0 <= recent <= self.budget:
            raise ValueError(f"ahakv: recent must be in [0, budget={self.budget}], got {recent}")
        if p.ra and recent == 0:
            raise ValueError("ahakv: recent must be >= 1 with ra=True (RA accumulates the last `recent` rows)")
        if p.kernel < 1 or p.kernel % 2 == 0:
            raise ValueError(f"ahakv: kernel must be a positive odd number, got {p.kernel}")
        self.recent = recent

    def observed_rows(self) -> int | None:
        return self.recent if self.params.ra else None

    def observe(self, slots: Slots, obs: Observation) -> None:
        p = self.params
        sgs = p.sgs and (p.sgs_decode or obs.step_rows > 1)
        probs = step_gain_probs(obs, self.budget, p.sgs_tokens) if sgs else obs.probs
        if p.ra:
            probs = probs * (obs.query_pos > slots.last[:, None] - self.recent)[:, None, :, None]
        if p.vpe and obs.step_rows > 1:
            slots.state["score"] += probs.sum(dim=2) * value_prior(slots, p.kernel)
        else:
            accumulate(slots.state["score"], probs)

    def score_rule(self) -> ScoreRule:
        # (a stream's steps are single queries: no value prior, and RA counts each, its position being the newest)
        p = self.params
        gain = self.budget if p.sgs and p.sgs_decode and p.sgs_tokens == "seen" else 0
        return ScoreRule(accumulate=True, kept=Pattern.window(self.recent), gain=gain)

    def scan_rule(self) -> ScoreRule | None:
        p = self.params
        return None if p.sgs and p.sgs_decode and p.sgs_tokens == "kept" else self.score_rule()
