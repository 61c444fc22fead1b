"""Several caches in one forward pass: ``SharedPrompt`` fills each cache as its own forward pass of its tokens would
(the same kept tokens, policy state and logits), ``StackedRows`` decodes each cache's rows as that cache alone
(float64, so that round-off, which differs between a batch and a row alone, cannot decide a near-tie)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvsieve
from kvsieve.engine.memory import recorded_pass_bytes
from kvsieve.engine.shared import SharedPrompt, StackedRows
from kvsieve.policies import REGISTRY

PROMPT, CONTEXT = 48, 37  # (the question-agnostic caches take the first CONTEXT tokens)
SETTINGS = [  # (policy, budget, end, make_cache keywords)
    ("h2o", 0.5, None, {}),
    ("h2o", 0.25, CONTEXT, {"decode_budget": None}),
    ("tova", 0.5, None, {}),
    ("snapkv", 0.5, CONTEXT, {"decode_budget": None}),
    ("snapkv", 16, None, {}),
    ("scissorhands", 0.5, None, {}),
    ("ahakv", 0.5, None, {}),
    ("ahakv", 0.3, CONTEXT, {"decode_budget": None}),
    ("streaming_llm", 0.5, None, {}),
    ("knorm", 0.5, CONTEXT, {"decode_budget": None}),
    ("local", 0.5, None, {}),
    ("h2o:recent=0,normalize=true", 0.5, None, {}),
    ("full", None, None, {}),
    # (observing as settings above, over the same rows: their states are copies)
    ("h2o+local", 0.25, None, {}),
    ("h2o+strided", 0.5, CONTEXT, {"decode_budget": None}),
    ("scissorhands", 0.3, None, {}),
    ("tova", 0.3, None, {}),
]


def _caches(model):
    return [kvsieve.make_cache(model, policy, budget, **kw) for policy, budget, _, kw in SETTINGS]


def _held(cache) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each layer's held positions and policy state (the slots in use)."""
    return [(layer.held_positions(), layer.held_state()) for layer in cache.layers]


@pytest.mark.parametrize("model_name", ["llama_gqa", "gemma3"])
def test_shared_prompt_fills_each_cache_as_alone_and_stacked_rows_decode_as_alone(
    tiny_models, make_ids, model_name
) -> None:
    model = tiny_models(model_name, torch.float64)
    ids = make_ids(1, PROMPT, seed=4)
    ends = [end for _, _, end, _ in SETTINGS]
    shared, alone = _caches(model), _caches(model)
    with torch.inference_mode():
        logits = model(ids, cache=SharedPrompt(shared, ends)).logits
        for (policy, *_), end, cache, solo in zip(SETTINGS, ends, shared, alone, strict=True):
            want = model(ids[:, :end], cache=solo).logits
            if end is None:
                torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12, msg=policy)
            for (pos, state), (want_pos, want_state) in zip(_held(cache), _held(solo), strict=True):
                assert torch.equal(pos, want_pos), policy
                for name, value in state.items():
                    torch.testing.assert_close(value, want_state[name], rtol=1e-12, atol=1e-12, msg=policy)
        # The question-agnostic caches take the rest of the prompt as a batch; then every cache decodes in one.
        asking = [i for i, end in enumerate(ends) if end is not None]
        model(ids[:, CONTEXT:].expand(len(asking), -1), cache=StackedRows([shared[i] for i in asking]))
        for i in asking:
            model(ids[:, CONTEXT:], cache=alone[i])
        steps, feeds = 8, make_ids(len(SETTINGS), 8, seed=5)
        stack, rows = StackedRows(shared), list(range(len(SETTINGS)))
        got = {row: [] for row in rows}
        for t in range(steps):
            out = model(feeds[rows, t : t + 1], cache=stack).logits
            for i, row in enumerate(rows):
                got[row].append(out[i])
            if t in (2, 5):  # rows leave: every third, then the first of those left (a cache with its only row)
                keep = [i for i in range(len(rows)) if i % 3 != 1] if t == 2 else list(range(1, len(rows)))
                stack.batch_select_indices(torch.tensor(keep))
                rows = [rows[i] for i in keep]
        assert len(stack.caches) == len(rows)
        for row, solo in enumerate(alone):
            want = torch.cat([model(feeds[row : row + 1, t : t + 1], cache=solo).logits for t in range(len(got[row]))])
            torch.testing.assert_close(torch.cat(got[row]), want.squeeze(1), rtol=1e-9, atol=1e-9, msg=SETTINGS[row][0])


def test_policies_that_observe_alike_over_the_same_rows_observe_once(tiny_models, make_ids, monkeypatch) -> None:
    model = tiny_models("llama_gqa", torch.float32)
    caches, observers = _caches(model), set()
    for cls in {c for policy in REGISTRY.values() for c in policy.__mro__ if "observe" in vars(c)}:

        def counted(self, slots, obs, observe=cls.observe) -> None:
            observers.add(id(self))
            observe(self, slots, obs)

        monkeypatch.setattr(cls, "observe", counted)
    with torch.inference_mode():
        model(make_ids(1, PROMPT, seed=4), cache=SharedPrompt(caches, [end for _, _, end, _ in SETTINGS]))
    observed = {
        f"{policy}@{budget}/{end}"
        for (policy, budget, end, _), cache in zip(SETTINGS, caches, strict=True)
        if any(id(layer.policy) in observers for layer in cache.layers)
    }
    # (h2o's normalize and recent, the h2o+ patterns, budgets: they keep differently, they observe alike)
    assert observed == {
        "h2o@0.5/None", "h2o@0.25/37", "tova@0.5/None", "snapkv@0.5/37", "snapkv@16/None", "scissorhands@0.5/None",
        "ahakv@0.5/None", "ahakv@0.3/37",
    }  # fmt: skip


def test_stacked_rows_of_batched_caches(tiny_models, make_ids) -> None:
    """A cache of several rows keeps them together in a stack; rows are selected within it."""
    model = tiny_models("llama_gqa", torch.float64)
    ids = make_ids(3, 20, seed=2)
    first, second = kvsieve.make_cache(model, "h2o", 8), kvsieve.make_cache(model, "tova", 6)
    solo = [kvsieve.make_cache(model, "h2o", 8), kvsieve.make_cache(model, "tova", 6)]
    feeds = make_ids(3, 3, seed=3)
    with torch.inference_mode():
        model(ids[:2], cache=first)
        model(ids[2:], cache=second)
        model(ids[:2], cache=solo[0])
        model(ids[2:], cache=solo[1])
        stack = StackedRows([first, second])
        got = model(feeds[:, :1], cache=stack).logits
        torch.testing.assert_close(got[:2], model(feeds[:2, :1], cache=solo[0]).logits, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got[2:], model(feeds[2:, :1], cache=solo[1]).logits, rtol=1e-9, atol=1e-9)
        stack.batch_select_indices(torch.tensor([1, 2]))
        solo[0].batch_select_indices(torch.tensor([1]))
        got = model(feeds[1:, 1:2], cache=stack).logits
        torch.testing.assert_close(got[:1], model(feeds[1:2, 1:2], cache=solo[0]).logits, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got[1:], model(feeds[2:, 1:2], cache=solo[1]).logits, rtol=1e-9, atol=1e-9)
        with pytest.raises(ValueError, match="ascending"):
            stack.batch_select_indices(torch.tensor([1, 0]))


def test_what_a_shared_prompt_refuses(tiny_models, make_ids) -> None:
    model = tiny_models("llama_gqa", torch.float32)
    ids = make_ids(2, 12, seed=1)
    used = kvsieve.make_cache(model, "h2o", 4)
    with torch.inference_mode():
        model(ids, cache=used)
    with pytest.raises(ValueError, match="empty caches"):
        SharedPrompt([used])
    with pytest.raises(ValueError, match="2 ends for 1 caches"):
        SharedPrompt([kvsieve.make_cache(model, "h2o", 4)], [3, 4])
    with pytest.raises(ValueError, match="end must be in"), torch.inference_mode():
        model(ids, cache=SharedPrompt([kvsieve.make_cache(model, "h2o", 4)], [13]))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    cache = kvsieve.make_cache(model, "h2o", 4)
    with pytest.raises(ValueError, match="padding"), torch.inference_mode():
        model(ids, attention_mask=mask, cache=SharedPrompt([cache]))
    with torch.inference_mode():  # (nothing half-done: the cache takes a prompt of its own afterwards)
        model(ids, cache=cache)
    assert cache.get_seq_length() == 12
    for kwargs in ({"kv_bits": 8, "group_size": 16}, {"rolling": True}, {"stream": True}):
        plain, other = kvsieve.make_cache(model, "h2o", 4), kvsieve.make_cache(model, "h2o", 4, **kwargs)
        with pytest.raises(ValueError, match="plain slots"), torch.inference_mode():
            model(ids, cache=SharedPrompt([plain, other]))
        with torch.inference_mode():
            for cache in (plain, other):
                model(ids, cache=cache)
                assert cache.get_seq_length() == 12
    with pytest.raises(ValueError, match="hold tokens"):
        StackedRows([kvsieve.make_cache(model, "h2o", 4)])


@pytest.mark.parametrize("model_name", ["llama_gqa", "gemma3"])
def test_stacked_rows_of_different_prompts_decode_as_alone(tiny_models, make_ids, model_name) -> None:
    """Caches of prompts of different lengths stack, each row at its own position (the step passes
    ``position_ids``); a cache joins a stack between steps; steps without the right position ids are refused with
    nothing stored."""
    model = tiny_models(model_name, torch.float64)
    settings = [("h2o", 6, {}), ("snapkv", 0.5, {"decode_budget": None}), ("full", None, {}), ("tova", 5, {})]
    lengths, steps = (17, 9, 23, 12), 6
    feeds = make_ids(len(settings), steps, seed=7)

    def prefilled() -> list:
        caches = [kvsieve.make_cache(model, policy, budget, **kw) for policy, budget, kw in settings]
        for i, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
            model(make_ids(1, n, seed=10 + i), cache=cache)
        return caches

    with torch.inference_mode():
        caches, alone = prefilled(), prefilled()
        want = [
            torch.cat([model(feeds[i : i + 1, t : t + 1], cache=c).logits for t in range(steps)])
            for i, c in enumerate(alone)
        ]
        stack = StackedRows(caches[:3])
        seen = [c.get_seq_length() for c in caches]
        with pytest.raises(ValueError, match=r"pass position_ids=stack.position_ids\(1\); got \[\[17\]\]"):
            model(feeds[:3, :1], cache=stack)
        with pytest.raises(ValueError, match="each row's next ones"):
            model(feeds[:3, :1], position_ids=stack.position_ids() + 1, cache=stack)
        assert [c.get_seq_length() for c in caches] == seen  # (nothing stored)
        rows, got = [0, 1, 2], {i: [] for i in range(len(settings))}
        done = dict.fromkeys(range(len(settings)), 0)
        for t in range(steps + 2):
            if t == 2:  # the last cache joins; then the second leaves
                stack, rows = StackedRows([*stack.caches, caches[3]]), [*rows, 3]
            ids = torch.stack([feeds[i, done[i]] for i in rows])[:, None]
            assert stack.position_ids().flatten().tolist() == [lengths[i] + done[i] for i in rows]
            logits = model(ids, position_ids=stack.position_ids(), cache=stack).logits
            for r, i in enumerate(rows):
                got[i].append(logits[r])
                done[i] += 1
            if t == 3:
                stack.batch_select_indices(torch.tensor([0, 2, 3]))
                rows.remove(1)
            rows_done = [i for i in rows if done[i] == steps]
            if rows_done:
                keep = [r for r, i in enumerate(rows) if i not in rows_done]
                if not keep:
                    break
                stack.batch_select_indices(torch.tensor(keep))
                rows = [rows[r] for r in keep]
    for i, rows_got in got.items():
        n = len(rows_got)
        assert n >= 4, i
        torch.testing.assert_close(torch.cat(rows_got), want[i][:n].squeeze(1), rtol=1e-9, atol=1e-9, msg=str(i))


def test_a_dropped_stack_frees_its_caches_at_once(tiny_models, make_ids) -> None:
    """A stack holds no reference cycle: its caches (GBs on a long prompt) are freed when the last reference to them
    goes, not whenever Python's cyclic collector next runs."""
    model = tiny_models("llama_gqa", torch.float32)
    caches = [kvsieve.make_cache(model, "h2o", 4) for _ in range(3)]
    with torch.inference_mode():
        model(make_ids(1, 10, seed=1), cache=SharedPrompt(caches))
        stack = StackedRows(caches)
        model(make_ids(3, 1, seed=2), position_ids=stack.position_ids(), cache=stack)
        stack.batch_select_indices(torch.tensor([0, 2]))
        model(make_ids(2, 1, seed=3), position_ids=stack.position_ids(), cache=stack)
    alive = [weakref.ref(cache) for cache in caches]
    collecting = gc.isenabled()
    gc.disable()
    try:
        del caches, stack
        assert [ref() for ref in alive] == [None, None, None]
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("model_name", ["llama_gqa", "gemma3"])
def test_a_replayed_pass_fills_caches_as_their_own_pass(tiny_models, make_ids, model_name) -> None:
    """Caches filled from a recorded pass over the same prompt (the pass of other caches) hold what their own pass
    leaves them, bit for bit, and decode as those; the model then runs other caches as before."""
    model = tiny_models(model_name, torch.float32)
    ids = make_ids(1, PROMPT, seed=4)
    ends = [end for _, _, end, _ in SETTINGS]
    first, second = slice(0, 5), slice(5, None)  # (the caches of the recorded pass; those that replay it)
    recording = SharedPrompt(_caches(model)[first], ends[first], record=True)
    with pytest.raises(ValueError, match="no forward pass was recorded"):
        recording.recorded  # noqa: B018
    replayed, own = _caches(model)[second], _caches(model)[second]
    with torch.inference_mode():
        model(ids, cache=recording)
        SharedPrompt(replayed, ends[second]).replay(recording.recorded)
        model(ids, cache=SharedPrompt(own, ends[second]))
        for cache, want, (policy, *_) in zip(replayed, own, SETTINGS[second], strict=True):
            assert cache.get_seq_length() == want.get_seq_length()
            for layer, other in zip(cache.layers, want.layers, strict=True):
                assert torch.equal(layer.held_positions(), other.held_positions()), policy
                used = layer.store.used  # (the slots in use; the buffer's others were never written)
                assert torch.equal(layer.keys[:, :, :used], other.keys[:, :, :used]), policy
                for name, value in layer.held_state().items():
                    assert torch.equal(value, other.held_state()[name]), policy
        feed = make_ids(len(replayed), 1, seed=6)
        stacks = [StackedRows(c) for c in (replayed, own)]
        got, want = (model(feed, position_ids=s.position_ids(), cache=s).logits for s in stacks)
        assert torch.equal(got, want)
        plain = kvsieve.make_cache(model, "h2o", 4)  # (no hand-over left behind: another cache runs as ever)
        model(ids, cache=plain)
        assert plain.get_seq_length() == PROMPT
    assert recording.recorded.nbytes == recorded_pass_bytes(model, PROMPT) > 0  # (as known before the pass)
    with pytest.raises(ValueError, match="records nothing"):
        SharedPrompt(_caches(model)[:1]).recorded  # noqa: B018
    with pytest.raises(ValueError, match="end must be in"):
        SharedPrompt(_caches(model)[:1], [PROMPT + 1]).replay(recording.recorded)


def test_a_pass_recorded_on_another_depth_is_refused(tiny_models, make_ids) -> None:
    llama, gemma = tiny_models("llama_gqa", torch.float32), tiny_models("gemma3", torch.float32)
    recording = SharedPrompt([kvsieve.make_cache(llama, "h2o", 4)], record=True)
    with torch.inference_mode():
        llama(make_ids(1, 12, seed=1), cache=recording)
    cache = kvsieve.make_cache(gemma, "h2o", 4)
    with pytest.raises(ValueError, match="recorded over 3 layers cannot fill caches of 4"):
        SharedPrompt([cache]).replay(recording.recorded)
    assert cache.get_seq_length() == 0  # (nothing stored)
