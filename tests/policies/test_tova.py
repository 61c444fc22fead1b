"""TOVA keeps the top of the last query's attention (summed over heads, or per head), checked on the captured
observations."""

from __future__ import annotations

import pytest
from policy_runs import capture, run_kept

from kvsieve.policies.tova import TOVA


@pytest.mark.parametrize("per_head", [False, True])
def test_tova_keeps_the_top_of_the_last_query(llama_gqa, stream, make_ids, monkeypatch, per_head) -> None:
    calls = capture(monkeypatch, TOVA)
    budget, steps = 7, 6
    kept = run_kept(llama_gqa, "tova", budget, make_ids(2, 18), steps, stream, kernels="torch", per_head=per_head)
    n_layers = len(kept[0])
    assert len(calls) == n_layers * (steps + 1)  # one block per step and layer
    for i, (_, pos, obs) in enumerate(calls):
        step, layer = divmod(i, n_layers)
        score = obs.probs[:, :, -1]
        if not per_head:
            score = score.sum(dim=1, keepdim=True).expand_as(score)
        for b in range(2):
            for h in range(score.shape[1]):
                top = score[b, h].topk(budget).indices
                assert kept[step][layer][b][h] == set(pos[b, h, top].tolist()), f"step {step} layer {layer}"
    heads_differ = any(row[0] != row[1] for layer in kept[-1] for row in layer)
    assert heads_differ == per_head
