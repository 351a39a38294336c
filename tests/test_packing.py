"""Micro-batch layouts of the policy update (oar.models.packing, train.packing): every padding-free layout
gives the padded path's loss and gradients for every loss aggregation, and computes fewer positions."""

from __future__ import annotations

import copy

import pytest
import torch

from oar.trainer.loss import AGG_MODES
from oar.models.packing import group_by_length, pack_first_fit, padding_report, plan_micro_batches
from oar.rollout import Rollout, pad_stack


def _rollout(seed: int = 0, *, prompts: int = 4, n: int = 3, vocab: int = 99) -> tuple[Rollout, torch.Tensor]:
    """Groups of ``n`` responses per prompt; prompt lengths 3-9 and response lengths 1-12 vary."""
    g = torch.Generator().manual_seed(seed)
    P, R = [], []
    for _ in range(prompts):
        p = torch.randint(4, vocab, (1, int(torch.randint(3, 10, (1,), generator=g))), generator=g)
        for _ in range(n):
            P.append(p)
            R.append(torch.randint(4, vocab, (1, int(torch.randint(1, 13, (1,), generator=g))), generator=g))
    pid, pm = pad_stack(P, 0, left=True), pad_stack([torch.ones_like(x) for x in P], 0, left=True)
    rid, rm = pad_stack(R, 0, left=False), pad_stack([torch.ones_like(x) for x in R], 0, left=False)
    N, T = rid.shape
    ro = Rollout(prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm,
                 logprobs=-(torch.rand(N, T, generator=g) * 3 + 2) * rm, texts=[""] * N,
                 prompt_index=torch.arange(N) // n, truncated=torch.zeros(N, dtype=torch.bool))
    return ro, torch.randn(N, T, generator=g) * rm


def _update(model0, ro, adv, agg: str, *, ref=None, **layout) -> tuple[dict, dict[str, torch.Tensor]]:
    """One mini-batch of ``oar.trainer.update.update_policy`` with lr 0: its statistics and the gradient it left."""
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy
    from oar.trainer.update import update_policy

    model = copy.deepcopy(model0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    from oar.config.settings import TrainSettings

    train = TrainSettings.from_config({"train": {"mini_batch_size": 64, "micro_batch_size": 64, "ppo_epochs": 1,
                                                 "grad_clip": 1e9, **layout}})
    recipe = {"loss_agg": agg, "eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": 3.0, "kl_coef": 0.1 if ref else 0.0}
    upd, bad = update_policy(model, opt, make_strategy(TrainSettings.from_config({"train": {"strategy": "ddp"}}), "cpu"), ro, adv, ref,
                              recipe=recipe, train=train, temperature=0.9,
                              agg_max_len=16 if agg == "seq-mean-token-sum-norm" else None,
                              generator=torch.Generator().manual_seed(0))
    assert bad == 0
    return upd, {k: p.grad.clone() for k, p in model.named_parameters()}


LAYOUTS = {
    "length_grouped": {"packing": "length_grouped", "micro_batch_tokens": 48},
    "packed": {"packing": "packed", "micro_batch_tokens": 64, "pack_length": 32},
    "shared_prompt": {"packing": "shared_prompt", "micro_batch_tokens": 40},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_layout_gives_the_padded_paths_loss_and_gradients(layout, agg):
    from oar.models.tiny import build_tiny

    model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    ref, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    ro, adv = _rollout()
    old, g_old = _update(model, ro, adv, agg, ref=ref.eval(), packing="none")
    new, g_new = _update(model, ro, adv, agg, ref=ref.eval(), **LAYOUTS[layout])
    # several micro-batches of different sizes: the weights, not luck, make them add up
    assert len(old["tokens_real"]) == 1 and len(new["tokens_real"]) >= 3
    for k in ("loss", "pg_loss", "kl_ref", "entropy", "clipfrac", "approx_kl"):
        assert new[k] == pytest.approx(old[k], rel=1e-5, abs=1e-7), k
    assert old["loss"][0] != 0 and old["kl_ref"][0] > 0
    assert any(float(g.abs().max()) > 0 for g in g_old.values())
    for k in g_old:
        torch.testing.assert_close(g_new[k], g_old[k], rtol=1e-5, atol=1e-7, msg=k)
    # fewer positions computed than the padded path (which pads every row to 9 + 12 tokens)
    assert sum(new["tokens_computed"]) < sum(old["tokens_computed"])
    assert sum(new["tokens_real"]) <= sum(old["tokens_real"]) == int(ro.prompt_mask.sum() + ro.response_mask.sum())


@pytest.mark.parametrize("agg", AGG_MODES)
def test_skip_zero_advantage_leaves_the_loss_and_gradient(agg):
    """train.skip_zero_advantage: the rows whose advantages are all 0 are not computed, the mini-batch's
    loss and gradient stay those of every row; with a KL term nothing is skipped."""
    from oar.models.tiny import build_tiny
    from oar.credit.metrics import credited_rows

    model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    ref, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    ro, adv = _rollout()
    adv[:6] = 0.0                                   # groups 0 and 1 scored alike
    adv[6, ro.response_mask[6].sum():] = 5.0        # non-zero past the response only: row 6 stays credited
    assert credited_rows(adv, ro.response_mask).nonzero().flatten().tolist() == list(range(6, 12))
    layout = LAYOUTS["shared_prompt"]
    old, g_old = _update(model, ro, adv, agg, **layout)
    new, g_new = _update(model, ro, adv, agg, skip_zero_advantage=True, **layout)
    for k in ("loss", "pg_loss"):
        assert new[k] == pytest.approx(old[k], rel=1e-5, abs=1e-7), k
    assert old["loss"][0] != 0
    for k in g_old:
        torch.testing.assert_close(g_new[k], g_old[k], rtol=1e-5, atol=1e-7, msg=k)
    credited_tokens = int(ro.response_mask[6:].sum()) + int(ro.prompt_mask[6:].sum())
    assert sum(new["tokens_real"]) < sum(old["tokens_real"])
    assert sum(new["tokens_real"]) <= credited_tokens
    # a KL term has a gradient on every row: nothing is left out
    kl_old, _ = _update(model, ro, adv, agg, ref=ref.eval(), **layout)
    kl_new, _ = _update(model, ro, adv, agg, ref=ref.eval(), skip_zero_advantage=True, **layout)
    assert sum(kl_new["tokens_real"]) == sum(kl_old["tokens_real"])
    assert kl_new["loss"] == pytest.approx(kl_old["loss"], rel=1e-6)


def test_skip_zero_advantage_with_nothing_credited_still_steps():
    """A mini-batch with no credited row runs one zero-weight micro-batch: every parameter gets a zero
    gradient, so an optimizer with momentum moves the weights exactly as with every row computed."""
    from oar.models.tiny import build_tiny
    from oar.config.settings import TrainSettings
    from oar.trainer.strategy import make_strategy
    from oar.trainer.update import update_policy
    from oar.config.settings import TrainSettings

    ro, adv = _rollout()
    weights = {}
    for skip in (False, True):
        model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train = TrainSettings.from_config({"train": {"mini_batch_size": 64, "micro_batch_size": 64,
                                                     "skip_zero_advantage": skip, **LAYOUTS["shared_prompt"]}})
        recipe = {"loss_agg": "token-mean", "eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": None, "kl_coef": 0.0}
        stats = []
        for a in (adv, torch.zeros_like(adv)):      # a credited step, then one with nothing credited
            upd, bad = update_policy(model, opt, make_strategy(TrainSettings.from_config({"train": {"strategy": "ddp"}}), "cpu"), ro, a,
                                     None, recipe=recipe, train=train, temperature=1.0, agg_max_len=None,
                                     generator=torch.Generator().manual_seed(0))
            assert bad == 0
            stats.append(upd)
        assert skip is False or stats[1]["tokens_real"] == []
        weights[skip] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(weights[False], weights[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_shared_prompt_under_eager_attention_matches_sdpa():
    """shared_prompt passes its own 4-D mask: boolean to sdpa, additive to eager; same log-probs."""
    from oar.models.tiny import build_tiny
    from oar.models.packing import micro_batch_logprobs

    ro, _ = _rollout(3)
    rows = torch.arange(ro.response_ids.shape[0])
    (mb,) = plan_micro_batches(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, rows,
                               packing="shared_prompt", micro_batch_size=64)
    (ref,) = plan_micro_batches(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, rows,
                                packing="none", micro_batch_size=64)
    out = {}
    for impl in ("sdpa", "eager"):
        model, _ = build_tiny(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, attn_implementation=impl)
        with torch.no_grad():
            lp, ent = micro_batch_logprobs(model, mb, with_entropy=True)
            lp0, ent0 = micro_batch_logprobs(model, ref, with_entropy=True)
        # back to the padded path's row order
        full = torch.zeros_like(lp0)
        full[mb.rows, : mb.T] = lp
        torch.testing.assert_close(full[ref.rows.argsort()], lp0[ref.rows.argsort()], rtol=1e-5, atol=1e-5)
        out[impl] = full
    torch.testing.assert_close(out["eager"], out["sdpa"], rtol=1e-5, atol=1e-5)


def test_shared_prompt_row_layout():
    """Two responses of one prompt: one row [p0 p1 | a0 a1 | b0], positions 0 1 | 2 3 | 2, the
    prompt's last position predicting both first tokens."""
    prompt_ids = torch.tensor([[0, 7, 8], [0, 7, 8]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    response_ids = torch.tensor([[20, 21], [30, 0]])
    response_mask = torch.tensor([[1, 1], [1, 0]])
    (mb,) = plan_micro_batches(prompt_ids, prompt_mask, response_ids, response_mask, [0, 1],
                               packing="shared_prompt", micro_batch_size=8)
    assert mb.input_ids.tolist() == [[7, 8, 20, 21, 30]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    allowed = mb.attention_mask[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert mb.logits_to_keep.tolist() == [[False, True, True, False, False]]  # kept rows: positions 1, 2
    assert mb.rows.tolist() == [0, 1] and mb.T == 2
    assert mb.targets.tolist() == [20, 21, 30] and mb.index.tolist() == [0, 1, 2] and mb.src.tolist() == [0, 1, 0]
    assert (mb.real_tokens, mb.computed_tokens, mb.logit_rows) == (5, 5, 2)


def test_length_grouped_and_packed_rows_have_no_inner_padding():
    ro, _ = _rollout(1)
    rows = torch.arange(ro.response_ids.shape[0])
    lens = (ro.prompt_mask.sum(1) + ro.response_mask.sum(1)).tolist()
    for packing, kw in (("length_grouped", {"micro_batch_tokens": 60}), ("packed", {"pack_length": 30})):
        plan = plan_micro_batches(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, rows,
                                  packing=packing, micro_batch_size=64, **kw)
        assert sorted(int(r) for m in plan for r in m.rows) == rows.tolist()
        for m in plan:
            assert m.attention_mask is None
            if packing == "length_grouped":  # one sequence per row from position 0, padded on the right
                assert m.computed_tokens <= 60 or len(m.rows) == 1
                for b, r in enumerate(m.rows.tolist()):
                    assert m.position_ids[b].tolist() == list(range(m.input_ids.shape[1]))
                    assert m.input_ids[b, : lens[r]].tolist() == (
                        ro.prompt_ids[r][ro.prompt_mask[r].bool()].tolist() + ro.response_ids[r][: lens[r] - int(ro.prompt_mask[r].sum())].tolist())
            else:  # positions restart at 0 for every sequence
                assert int((m.position_ids == 0).sum()) >= len(m.rows)
        rep = padding_report(plan)
        assert rep["real_tokens"] == sum(lens) and rep["computed_tokens"] >= rep["real_tokens"]
        assert rep["logit_rows"] == int(ro.response_mask.sum())


def test_group_by_length_fewest_groups_then_least_padding():
    # 2 groups are needed (8 x 264 > 2048); of the 2-group cuts, [264 250] + the six others pads least
    assert group_by_length([264, 250, 240, 240, 230, 230, 220, 210], max_rows=8, max_tokens=2048) == [
        [0, 1], [2, 3, 4, 5, 6, 7]]
    assert group_by_length([5, 3, 9, 1], max_rows=2, max_tokens=None) == [[2, 0], [1, 3]]
    assert group_by_length([50, 3, 3], max_rows=8, max_tokens=10) == [[0], [1, 2]]  # too long: alone
    # 5 sequences > 4: two groups; [6] + [4 4] pads less than [6 4] + [4]
    assert group_by_length([6, 4, 4], max_rows=4, max_tokens=None, sizes=[2, 2, 1]) == [[0], [1, 2]]
    assert group_by_length([], max_rows=4, max_tokens=8) == []


def test_pack_first_fit_decreasing():
    assert pack_first_fit([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert pack_first_fit([9, 2], 8) == [[0], [1]]
    assert pack_first_fit([2, 3], None) == [[1, 0]]


def test_unknown_packing_is_a_named_error():
    ro, _ = _rollout()
    with pytest.raises(ValueError, match="train.packing: unknown layout 'pad'"):
        plan_micro_batches(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, [0], packing="pad",
                           micro_batch_size=4)
