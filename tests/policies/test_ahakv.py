"""AhaKV against a naive reference (RA, SGS, VPE on and off; see ``policy_runs``), and its step-gain softmax and
value prior on synthetic inputs."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from policy_runs import BUDGET, Call, Reference, keep_recent_and_best, record, replay, softmax

import kvsieve
from kvsieve.policies import Observation, Slots
from kvsieve.policies.ahakv import AhaKV, step_gain_probs, value_prior


class AhaKVReference(Reference):
    def __init__(
        self,
        budget: int,
        group: int,
        recent: int,
        ra: bool,
        sgs: bool,
        vpe: bool,
        kernel: int,
        sgs_tokens: str = "seen",
        sgs_decode: bool = True,
    ) -> None:
        super().__init__(budget, group)
        self.recent, self.ra, self.sgs, self.vpe, self.kernel = recent, ra, sgs, vpe, kernel
        self.sgs_tokens, self.sgs_decode = sgs_tokens, sgs_decode
        self.prior: dict[int, float] = {}
        self.step_rows = 0

    def begin(self, call: Call, b: int, h: int) -> None:
        """γ̄ of the call's tokens: squared value norms, mean over a centred window in position order, / max."""
        self.prior = {}
        self.step_rows = call.step_rows
        if not (self.vpe and call.step_rows > 1):
            return
        tokens = sorted(
            (p, sum(v * v for v in values))
            for p, values in zip(call.pos[b][h], call.values[b][h], strict=True)
            if p >= 0
        )
        half = self.kernel // 2
        pooled = []
        for j in range(len(tokens)):
            window = tokens[max(0, j - half) : j + half + 1]
            pooled.append(sum(nu for _, nu in window) / len(window))
        self.prior = {p: g / max(pooled) for (p, _), g in zip(tokens, pooled, strict=True)}

    def row(self, call: Call, b: int, h: int, r: int) -> None:
        qp, last = call.query_pos[b][r], call.last[b]
        if self.ra and qp <= last - self.recent:
            return
        allowed = call.allowed[b][h][r]
        i = qp + 1 if self.sgs_tokens == "seen" else sum(allowed)
        gain = math.sqrt(2 * math.log(i / self.budget)) if i > self.budget else 0.0
        sgs = self.sgs and (self.sgs_decode or self.step_rows > 1)
        for s, p in enumerate(call.pos[b][h]):
            if not allowed[s]:
                continue
            if sgs:
                a = sum(softmax(call.logits[b][h][g][r], allowed, gain)[s] for g in range(self.group))
            else:
                a = call.probs[b][h][r][s]
            self.score[p] += a * self.prior.get(p, 1.0)

    def keep(self, present: set[int], last: int, n_keep: int) -> set[int]:
        return keep_recent_and_best(present, last, n_keep, self.recent, key=lambda p: self.score[p])


@pytest.mark.parametrize("vpe", [True, False], ids=["vpe", "no-vpe"])
@pytest.mark.parametrize("sgs", [True, False], ids=["sgs", "no-sgs"])
@pytest.mark.parametrize("ra", [True, False], ids=["ra", "no-ra"])
def test_ahakv_matches_reference(llama_gqa, stream, monkeypatch, ra, sgs, vpe) -> None:
    run = record(llama_gqa, stream, monkeypatch, "ahakv", recent=3, ra=ra, sgs=sgs, vpe=vpe, kernel=3)
    replay(run, partial(AhaKVReference, BUDGET, 2, 3, ra, sgs, vpe, 3), lambda state: state["score"])


@pytest.mark.parametrize(("sgs_tokens", "sgs_decode"), [("kept", True), ("seen", False), ("kept", False)])
def test_ahakv_sgs_readings_match_reference(llama_gqa, stream, monkeypatch, sgs_tokens, sgs_decode) -> None:
    params = {"recent": 3, "kernel": 3, "sgs_tokens": sgs_tokens, "sgs_decode": sgs_decode}
    run = record(llama_gqa, stream, monkeypatch, "ahakv", **params)
    reference = partial(AhaKVReference, BUDGET, 2, 3, True, True, True, 3, sgs_tokens, sgs_decode)
    replay(run, reference, lambda state: state["score"])
    assert run.slots != record(llama_gqa, stream, monkeypatch, "ahakv", recent=3, kernel=3).slots


def test_ahakv_components_change_decisions(llama_gqa, stream, monkeypatch) -> None:
    full = record(llama_gqa, stream, monkeypatch, "ahakv", recent=3).slots
    for off in ("ra", "sgs", "vpe"):
        assert record(llama_gqa, stream, monkeypatch, "ahakv", recent=3, **{off: False}).slots != full, off


def test_ahakv_with_every_component_off_is_h2o(llama_gqa, stream, monkeypatch) -> None:
    """RA, SGS and VPE off: accumulated probabilities + the last B_r tokens, i.e. H2O with ``recent = B_r``."""
    ablated = record(llama_gqa, stream, monkeypatch, "ahakv", recent=3, ra=False, sgs=False, vpe=False)
    h2o = record(llama_gqa, stream, monkeypatch, "h2o", recent=3)
    assert ablated.slots == h2o.slots


def _observation(logits: torch.Tensor, query_pos: list[int], step_rows: int = 1) -> Observation:
    """An observation of ``logits`` ``[1, 1, G, b, N]`` with causal masking by slot index = position."""
    n = logits.shape[-1]
    qp = torch.tensor([query_pos])
    allowed = torch.arange(n)[None, None, None, :] <= qp[:, None, :, None]
    logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    probs = logits.softmax(dim=-1).sum(dim=2)
    return Observation(probs, logits, qp, step_rows, key_pos=torch.arange(n).view(1, 1, n))


def test_step_gain_softmax_scales_logits_by_sqrt_2_ln_i_over_k() -> None:
    logits = torch.randn(1, 1, 2, 2, 40, generator=torch.Generator().manual_seed(0))
    obs = _observation(logits, [9, 39])  # rows that have seen 10 and 40 tokens
    got = step_gain_probs(obs, budget=10)
    # i = 10 <= k: the uniform distribution 1/i per query head (the group of 2 sums to 2/i).
    torch.testing.assert_close(got[0, 0, 0, :10], torch.full((10,), 2 / 10))
    assert got[0, 0, 0, 10:].abs().max() == 0
    # i = 40 > k: softmax of the scaled logits times sqrt(2 ln 4).
    expected = (logits[0, 0, :, 1] * math.sqrt(2 * math.log(4))).softmax(dim=-1).sum(dim=0)
    torch.testing.assert_close(got[0, 0, 1], expected)


def test_ahakv_sgs_scores_of_a_short_prompt_are_uniform(llama_gqa) -> None:
    """A prompt within the budget (every row has i <= k): each row gives every token it sees 1/i per query head."""
    length, group = 12, 2
    cache = kvsieve.make_cache(llama_gqa, "ahakv", 16, recent=4, ra=False, vpe=False)
    with torch.inference_mode():
        llama_gqa(torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(3)), cache=cache)
    expected = torch.tensor([sum(group / i for i in range(j + 1, length + 1)) for j in range(length)])
    for layer in cache.layers:
        torch.testing.assert_close(layer.held_state()["score"][0], expected.expand(2, -1))
    plain = kvsieve.make_cache(llama_gqa, "ahakv", 16, recent=4, ra=False, vpe=False, sgs=False)
    with torch.inference_mode():
        llama_gqa(torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(3)), cache=plain)
    assert not torch.allclose(plain.layers[0].held_state()["score"][0], expected.expand(2, -1))


def test_value_prior_pools_squared_norms_in_position_order() -> None:
    # One (row, head): slots hold positions 3, 0, -1 (empty), 2, 1 with value norms² 9, 1, -, 4, 16.
    pos = torch.tensor([[[3, 0, -1, 2, 1]]])
    values = torch.tensor([[3.0, 0.0], [1.0, 0.0], [7.0, 7.0], [0.0, 2.0], [0.0, 4.0]]).view(1, 1, 5, 2)
    slots = Slots(pos=pos, state={}, last=torch.tensor([3]), keys=values, values=values)
    # In position order ν = [1, 16, 4, 9]; kernel 3 (truncated at the ends): γ = [8.5, 7, 29/3, 6.5].
    gamma = torch.tensor([6.5, 8.5, 0.0, 29 / 3, 7.0])
    torch.testing.assert_close(value_prior(slots, 3), (gamma / (29 / 3)).view(1, 1, 5))
    torch.testing.assert_close(value_prior(slots, 1), torch.tensor([[[9 / 16, 1 / 16, 0.0, 4 / 16, 1.0]]]))


def test_ahakv_value_prior_applies_to_prompt_steps_only() -> None:
    obs_prompt = _observation(torch.zeros(1, 1, 2, 4, 4), [0, 1, 2, 3], step_rows=4)
    obs_decode = _observation(torch.zeros(1, 1, 2, 1, 4), [3], step_rows=1)
    values = torch.tensor([1.0, 2.0, 1.0, 2.0]).view(1, 1, 4, 1)
    policy = AhaKV(4, AhaKV.make_params(recent=1, ra=False, sgs=False, kernel=1))
    state = {"score": torch.zeros(1, 1, 4)}
    slots = Slots(pos=torch.arange(4).view(1, 1, 4), state=state, last=torch.tensor([3]), keys=values, values=values)
    policy.observe(slots, obs_prompt)
    # Uniform rows (zero logits): token j gets G/i from each row i > j; γ̄ = ν / max ν = [1/4, 1, 1/4, 1].
    prompt = torch.tensor([sum(2 / i for i in range(j + 1, 5)) for j in range(4)]) * torch.tensor([0.25, 1, 0.25, 1])
    torch.testing.assert_close(state["score"][0, 0], prompt)
    policy.observe(slots, obs_decode)  # a decode row: 2/4 to every token, no prior
    torch.testing.assert_close(state["score"][0, 0], prompt + 0.5)
