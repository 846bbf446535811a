"""TidalDecode's design-space options beyond the paper (METHODS.md B.2): ``tidal.selection`` = ``group_union`` /
``all_union`` and ``tidal.recent_share``.

- ``kernels.reference.select_topk_positions(mode=..., recent=...)`` against a brute force written here with Python
  loops (the union grown rank by rank, as METHODS.md B.2 states it), GQA groups 1/3/4/8, ragged lengths (some
  shorter than the budget), recent shares 0 / 0.25 / 0.5;
- a budget that reaches every token equals dense in ``model.generate`` for every mode (with the list built, and
  with ``covers_cache`` skipping it);
- the flat overrides' validation. The engine-equals-``generate()`` cases are ``tests/sparse_models/test_engine.py``
  (``SCHEMES``: ``tidal-group-union``, ``tidal-all-union``, ``tidal-recent``, ...).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from sparse_models import PodkitLlamaForCausalLM, SparseAttentionConfig
from sparse_models.schemes.tidal import recent_slots
from sparse_models.validation import ConfigError
from tests.tiny_models import tiny_model as factory_model

MODES = ("query_head", "kv_group", "group_union", "all_union")


def _recent(budget: int, share: float) -> int:
    """The recent window as the issue states it: max(1, round(share * budget)) when share > 0, else 1."""
    return max(1, round(share * budget)) if share > 0 else 1


def _probs(row: list[float], length: int) -> list[float]:
    """softmax over the first ``length`` entries of one head's logits."""
    top = max(row[:length])
    exps = [math.exp(x - top) for x in row[:length]]
    total = sum(exps)
    return [e / total for e in exps]


def _head_order(row: list[float], older: int) -> list[int]:
    """The older slots of one head, highest logit first (equal logits: the lower slot first)."""
    return sorted(range(older), key=lambda j: (-row[j], j))


def _brute_union(rows: list[list[float]], length: int, older: int, k: int) -> set[int]:
    """The union of the heads' top-r lists for the largest r that fits in k, completed from the heads' r-th
    entries by the heads' summed probability (highest first, then the lowest slot)."""
    orders = [_head_order(row, older) for row in rows]
    probs = [sum(_probs(row, length)[j] for row in rows) for j in range(older)]
    chosen: set[int] = set()
    for r in range(older):
        grown = chosen | {order[r] for order in orders}
        if len(grown) > k:
            extra = sorted(grown - chosen, key=lambda j: (-probs[j], j))
            return chosen | set(extra[:k - len(chosen)])
        chosen = grown
    return chosen


def _brute_topk(rows: list[list[float]], length: int, older: int, k: int, summed: bool) -> set[int]:
    """The k best older slots of one head by logit, or of a group by its summed probability."""
    if summed:
        key = [sum(_probs(row, length)[j] for row in rows) for j in range(older)]
    else:
        key = rows[0][:older]
    return set(sorted(range(older), key=lambda j: (-key[j], j))[:k])


def brute_select(scores: torch.Tensor, seq_lens: torch.Tensor, budget: int, group: int, mode: str,
                 recent: int) -> torch.Tensor:
    """Plain loops over sequences, lists and ranks: [B, Hq, N] logits -> [B, Hs, budget], ascending, -1 last."""
    batch, num_heads, _ = scores.shape
    per_list = {"query_head": 1, "kv_group": group, "group_union": group, "all_union": num_heads}[mode]
    out = []
    for b in range(batch):
        length = int(seq_lens[b])
        older = max(length - recent, 0)
        window = set(range(older, length))
        lists = []
        for first in range(0, num_heads, per_list):
            rows = [scores[b, h].tolist() for h in range(first, first + per_list)]
            if mode in ("group_union", "all_union"):
                picked = _brute_union(rows, length, older, budget - recent)
            else:
                picked = _brute_topk(rows, length, older, budget - recent, summed=mode == "kv_group")
            slots = sorted(picked | window)
            lists.append(slots + [-1] * (budget - len(slots)))
        if mode == "all_union":
            lists = lists * (num_heads // group)
        out.append(lists)
    return torch.tensor(out, dtype=torch.int64)


def random_scores(batch: int, num_heads: int, n: int, seq_lens: torch.Tensor, seed: int, ties: bool):
    """Logits [B, Hq, N] with garbage past seq_lens (never chosen); ``ties``: small integers, so heads tie."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (batch, num_heads, n), generator=g).double() if ties \
        else torch.randn(batch, num_heads, n, generator=g, dtype=torch.float64) * 3
    past_end = torch.arange(n)[None, None, :] >= seq_lens[:, None, None]
    return scores.masked_fill(past_end, float("-inf"))


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("share", [0.0, 0.25, 0.5])
@pytest.mark.parametrize("mode", MODES)
def test_selection_matches_brute_force(mode, share, group):
    """Ragged lengths: one below the budget (everything selected, -1 padded), one equal, two beyond it."""
    budget, num_kv, n = 12, 2, 40
    num_heads = group * num_kv
    seq_lens = torch.tensor([7, 12, 29, 40])
    recent = _recent(budget, share)
    for seed in range(3):
        ties = seed == 2 and mode in ("group_union", "all_union")  # topk orders tied logits arbitrarily
        scores = random_scores(4, num_heads, n, seq_lens, seed * 101 + group, ties)
        got = reference.select_topk_positions(scores, seq_lens, budget, group_size=group, mode=mode, recent=recent)
        want = brute_select(scores, seq_lens, budget, group, mode, recent)
        assert got.shape == (4, num_heads if mode == "query_head" else num_kv, budget)
        assert torch.equal(got, want), (mode, share, group, seed)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("kind", ["bf16_ties", "integer_ties", "signed_zeros", "distinct"])
def test_union_from_each_heads_top_k_equals_sorting_every_slot(kind, group):
    """``_union_from_top_k`` (each head's top-k, then only those candidates ordered) against the rule stated by
    sorting all N slots of every head (``_union_order``), over budgets from 1 to every older slot, on logits with
    many ties (bf16-rounded: as a bf16 model's are; small integers), with -0.0 beside +0.0, and without ties.
    Ragged: one sequence shorter than some budgets (-1 padding), one filling the cache. ``_union_lists`` (which
    picks a route by batch size) equals both, for the batch and for each sequence alone."""
    num_kv, n = 2, 300
    num_heads = group * num_kv
    seq_lens = torch.tensor([5, 97, 256, n])
    g = torch.Generator().manual_seed(group)
    scores = torch.randn(4, num_heads, n, generator=g) * 4
    if kind == "bf16_ties":
        scores = scores.to(torch.bfloat16).float()
    elif kind == "integer_ties":
        scores = torch.randint(-2, 3, (4, num_heads, n), generator=g).float()
    elif kind == "signed_zeros":
        scores = torch.where(torch.rand(4, num_heads, n, generator=g) < 0.5, torch.zeros(()), scores)
        scores = torch.where(torch.rand(4, num_heads, n, generator=g) < 0.5, -scores, scores)
    scores = scores.masked_fill(torch.arange(n)[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    older = torch.arange(n)[None, :] < (seq_lens[:, None] - 1)
    for heads_per_list in sorted({group, num_heads}):
        order = reference._union_order(scores, seq_lens, older, heads_per_list)
        for k in (1, 2, 7, 64, 200, n - 1):
            want = order[..., :k]
            want = torch.where(torch.gather(older[:, None, :].expand_as(order), -1, order)[..., :k], want, -1)
            got = reference._union_from_top_k(scores, seq_lens, older, k, heads_per_list)
            assert torch.equal(got, want), (kind, group, heads_per_list, k)
            assert torch.equal(reference._union_from_sort(scores, seq_lens, older, k, heads_per_list), want)
            assert torch.equal(reference._union_lists(scores, seq_lens, older, k, heads_per_list), want)
            for b in range(4):
                alone = reference._union_lists(scores[b:b + 1], seq_lens[b:b + 1], older[b:b + 1], k, heads_per_list)
                assert torch.equal(alone, want[b:b + 1]), (kind, group, heads_per_list, k, b)


def test_union_is_within_budget_and_keeps_every_heads_best_slot():
    """The rank-wise definition: every head's own best older slot is in its group's list (r = 1 always fits
    when the budget leaves at least G slots), and the list never exceeds the budget."""
    group, budget = 4, 9
    seq_lens = torch.tensor([64, 50])
    scores = random_scores(2, group * 2, 64, seq_lens, seed=7, ties=False)
    idx = reference.select_topk_positions(scores, seq_lens, budget, group_size=group, mode="group_union")
    assert ((idx >= 0).sum(-1) <= budget).all()
    for b in range(2):
        older = scores[b, :, : int(seq_lens[b]) - 1]
        for h in range(group * 2):
            assert int(older[h].argmax()) in idx[b, h // group].tolist()


def test_default_arguments_are_todays_selection():
    """mode=None / per_kv_group and recent=1 are the selection as it was (paper's rule, kv_group)."""
    seq_lens = torch.tensor([30, 17])
    scores = random_scores(2, 6, 32, seq_lens, seed=3, ties=False)
    for per_kv_group, mode in ((False, "query_head"), (True, "kv_group")):
        old = reference.select_topk_positions(scores, seq_lens, 10, group_size=3, per_kv_group=per_kv_group)
        assert torch.equal(old, reference.select_topk_positions(scores, seq_lens, 10, group_size=3, mode=mode,
                                                                recent=1))
        assert torch.equal(old, brute_select(scores, seq_lens, 10, 3, mode, 1))


def test_recent_window_sizes():
    """recent_share -> the window, current token included; 0.0 keeps only the current token."""
    def window(budget, share):
        config = SparseAttentionConfig().with_overrides(decode_scheme="tidal", tidal_budget=budget,
                                                        tidal_recent_share=share)
        return recent_slots(config.tidal)
    assert window(256, 0.0) == 1
    assert window(256, 0.25) == 64
    assert window(8, 0.5) == 4
    assert window(8, 0.01) == 1  # max(1, round(0.08))
    assert window(2, 0.9) == 2  # round(1.8): the whole budget is the window


# ---------------------------------------------------------------------------------------------------------------
# model path
# ---------------------------------------------------------------------------------------------------------------

def tiny_model(num_heads: int = 8, num_kv_heads: int = 2, seed: int = 0) -> PodkitLlamaForCausalLM:
    return factory_model(layers=4, seed=seed, vocab=128, heads=num_heads, kv_heads=num_kv_heads, hidden=16 * num_heads,
                         intermediate=96, positions=256, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None)


def generate(model, prompt, **overrides) -> list[int]:
    model.set_sparse_attention(SparseAttentionConfig(), **overrides)
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("share", [0.0, 0.25])
@pytest.mark.parametrize("mode", MODES)
def test_budget_reaching_every_token_equals_dense(mode, share):
    """Budget 40 > the 26 tokens but < the view's 64 slots: the selection runs and lists every slot; budget 64
    covers the view (``covers_cache``: exact attention). Both give dense's tokens; budget 6 does not."""
    model = tiny_model(seed=1)
    prompt = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    dense = generate(model, prompt)
    tidal = dict(decode_scheme="tidal", tidal_full_layers=[0], tidal_selection_layers=[1], tidal_selection=mode,
                 tidal_recent_share=share)
    assert generate(model, prompt, tidal_budget=40, **tidal) == dense
    assert generate(model, prompt, tidal_budget=64, **tidal) == dense
    assert generate(model, prompt, tidal_budget=6, **tidal) != dense


def test_union_lists_reach_the_sparse_layers_as_kv_head_lists():
    """The selection layer's lists are [B, Hkv, budget] for both union modes (all_union: one list repeated)."""
    model = tiny_model(seed=2)
    prompt = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    for mode in ("group_union", "all_union"):
        model.set_sparse_attention(SparseAttentionConfig(), decode_scheme="tidal", tidal_budget=8,
                                   tidal_full_layers=[0], tidal_selection_layers=[1], tidal_selection=mode)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        idx = out.past_key_values.selected_indices[1]
        assert idx.shape == (1, 2, 8), (mode, idx.shape)
        if mode == "all_union":
            assert torch.equal(idx[:, 0], idx[:, 1])
        assert out.past_key_values.tidal_indices is out.past_key_values.selected_indices  # the old name still reads


@pytest.mark.parametrize("overrides, field", [
    (dict(tidal_selection="union"), "tidal.selection"),
    (dict(tidal_selection=True), "tidal.selection"),
    (dict(tidal_recent_share=1.0), "tidal.recent_share"),
    (dict(tidal_recent_share=-0.1), "tidal.recent_share"),
    (dict(tidal_recent_share=True), "tidal.recent_share"),
    (dict(tidal_recent_share="0.25"), "tidal.recent_share"),
])
def test_bad_values_are_refused(overrides, field):
    with pytest.raises(ConfigError) as err:
        SparseAttentionConfig().with_overrides(decode_scheme="tidal", **overrides)
    message = str(err.value)
    assert message.startswith(f"{field}=")
    if field == "tidal.selection":
        for allowed in MODES:
            assert repr(allowed) in message
    else:
        assert "[0, 1)" in message


def test_good_values_round_trip():
    config = SparseAttentionConfig().with_overrides(decode_scheme="tidal", tidal_selection="all_union",
                                                    tidal_recent_share=0.25)
    again = SparseAttentionConfig.from_dict(config.to_dict())
    assert (again.tidal.selection, again.tidal.recent_share) == ("all_union", 0.25)
