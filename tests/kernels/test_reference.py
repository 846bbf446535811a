"""kernels/reference.py against per-query brute-force loops and torch SDPA.

The oracles below loop over (batch, head, query) and build each key set explicitly, so they share
no masking code with the reference they check.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref

GROUPS = [1, 3, 4, 8]


def _attend(q, keys, values):
    """softmax(q . keys / sqrt(D)) @ values for one query, fp64; keys/values [K, D]."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q)
    w = torch.softmax(keys @ q / math.sqrt(q.shape[-1]), dim=0)
    return w @ values


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("group", GROUPS)
def test_decode_attention_matches_loop(group):
    b, hkv, d, n = 3, 2, 16, 37
    hq = hkv * group
    q, k, v = _rand(b, hq, d), _rand(b, hkv, n, d), _rand(b, hkv, n, d)
    lens = torch.tensor([37, 5, 20])
    out, scores = ref.decode_attention(q, k, v, lens, return_scores=True)
    for bi in range(b):
        for h in range(hq):
            L = int(lens[bi])
            expect = _attend(q[bi, h], k[bi, h // group, :L], v[bi, h // group, :L])
            torch.testing.assert_close(out[bi, h], expect)
            assert torch.isinf(scores[bi, h, L:]).all()


@pytest.mark.parametrize("group", GROUPS)
def test_select_topk_includes_current_and_best_past(group):
    b, hkv, n, budget = 2, 2, 50, 8
    hq = hkv * group
    scores = torch.randn(b, hq, n)
    lens = torch.tensor([50, 6])
    idx = ref.select_topk_positions(scores, lens, budget)
    assert idx.shape == (b, hq, budget)
    for h in range(hq):
        L = 50
        expected = set(torch.topk(scores[0, h, : L - 1], budget - 1).indices.tolist()) | {L - 1}
        assert set(idx[0, h].tolist()) == expected
        # short sequence: every valid slot, then -1 padding
        assert idx[1, h].tolist() == [0, 1, 2, 3, 4, 5, -1, -1]


def test_select_topk_per_kv_group_shares_lists():
    scores = torch.randn(1, 6, 30)
    idx = ref.select_topk_positions(scores, torch.tensor([30]), 5, group_size=3, per_kv_group=True)
    assert idx.shape == (1, 2, 5)
    probs = torch.softmax(scores, -1)[0, :3, :29].sum(0)
    assert set(idx[0, 0].tolist()) == set(torch.topk(probs, 4).indices.tolist()) | {29}


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shared", [False, True])
def test_sparse_decode_matches_loop(group, shared):
    b, hkv, d, n, kk = 2, 2, 8, 40, 7
    hq = hkv * group
    q, k, v = _rand(b, hq, d), _rand(b, hkv, n, d), _rand(b, hkv, n, d)
    hs = hkv if shared else hq
    idx = torch.stack([torch.stack([torch.randperm(n)[:kk] for _ in range(hs)]) for _ in range(b)])
    idx[1, :, -2:] = -1
    out = ref.sparse_decode_attention(q, k, v, idx)
    for bi in range(b):
        for h in range(hq):
            lst = idx[bi, h // group if shared else h]
            lst = lst[lst >= 0]
            expect = _attend(q[bi, h], k[bi, h // group, lst], v[bi, h // group, lst])
            torch.testing.assert_close(out[bi, h], expect)


@pytest.mark.parametrize("group", GROUPS)
def test_prefill_matches_sdpa_and_offsets(group):
    b, hkv, d, s = 2, 2, 16, 19
    hq = hkv * group
    q, k, v = _rand(b, hq, s, d), _rand(b, hkv, s, d), _rand(b, hkv, s, d)
    out = ref.prefill_attention(q, k, v, torch.zeros(b, dtype=torch.long), torch.full((b,), s))
    expect = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)
    torch.testing.assert_close(out, expect)
    # a chunk of 4 queries at offset 10 of a 14-token sequence (ragged second sequence: 12)
    kv_lens = torch.tensor([14, 12])
    offs = torch.tensor([10, 8])
    out = ref.prefill_attention(q[:, :, :4], k, v, offs, kv_lens)
    for bi in range(b):
        for h in range(hq):
            for i in range(4):
                p = int(offs[bi]) + i
                end = min(p + 1, int(kv_lens[bi]))
                expect = _attend(q[bi, h, i], k[bi, h // group, :end], v[bi, h // group, :end])
                if p >= int(kv_lens[bi]):
                    expect = torch.zeros_like(expect)
                torch.testing.assert_close(out[bi, h, i], expect)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # fp32 takes the SDPA path
def test_sparse_prefill_matches_loop(group, dtype):
    b, hkv, d, s, kk = 2, 1, 8, 23, 9
    hq = hkv * group
    q, k, v = _rand(b, hq, s, d), _rand(b, hkv, s, d), _rand(b, hkv, s, d)
    idx = torch.sort(torch.stack([torch.stack([torch.randperm(s)[:kk] for _ in range(hq)]) for _ in range(b)]), -1).values
    idx[0, 0, :3] = -1  # padding
    out = ref.sparse_prefill_attention(q.to(dtype), k.to(dtype), v.to(dtype), idx).double()
    for bi in range(b):
        for h in range(hq):
            kept = [int(t) for t in idx[bi, h] if t >= 0]
            for i in range(s):
                if i not in kept:
                    assert torch.all(out[bi, h, i] == 0)
                    continue
                keys = [j for j in kept if j <= i]
                expect = _attend(q[bi, h, i], k[bi, h // group, keys], v[bi, h // group, keys])
                tolerance = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
                torch.testing.assert_close(out[bi, h, i], expect, **tolerance)


def test_token_sparse_scores_matches_loop():
    b, hq, hkv, d, s, w = 2, 4, 2, 8, 30, 6
    q, k = _rand(b, hq, s, d), _rand(b, hkv, s, d)
    lens = torch.tensor([30, 17])
    scores = ref.token_sparse_scores(q, k, lens, w)
    for bi in range(b):
        L = int(lens[bi])
        for h in range(hq):
            acc = torch.zeros(s, dtype=torch.float64)
            for i in range(L - w, L):
                logits = k[bi, h // 2, : i + 1] @ q[bi, h, i] / math.sqrt(d)
                acc[: i + 1] += torch.softmax(logits, 0)
            acc /= w
            acc[L - w:] = 0
            torch.testing.assert_close(scores[bi, h], acc)


@pytest.mark.parametrize("group", [1, 3])
def test_pod_prefill_matches_loop_and_gate(group):
    b, hkv, d, s, sink, recent = 2, 2, 8, 21, 2, 5
    hq = hkv * group
    q, ko, ka, v = _rand(b, hq, s, d), _rand(b, hkv, s, d), _rand(b, hkv, s, d), _rand(b, hkv, s, d)
    lens = torch.tensor([21, 13])
    out, gate = ref.pod_prefill_attention(q, ko, ka, v, lens, sink=sink, recent=recent, return_gate=True)
    for bi in range(b):
        for h in range(hq):
            for i in range(int(lens[bi])):
                keys = torch.stack([ko[bi, h // group, j] if (j < sink or i - j < recent) else ka[bi, h // group, j]
                                    for j in range(i + 1)])
                expect = _attend(q[bi, h, i], keys, v[bi, h // group, : i + 1])
                torch.testing.assert_close(out[bi, h, i], expect)
                logits = keys @ q[bi, h, i] / math.sqrt(d)
                prox = torch.tensor([j < sink or i - j < recent for j in range(i + 1)])
                g = torch.softmax(logits, 0)[prox].sum()
                torch.testing.assert_close(gate[bi, h, i], g)
    assert torch.all(out[1, :, 13:] == 0)


def test_pod_prefill_with_own_anchor_is_dense():
    q, k, v = _rand(1, 4, 17, 8), _rand(1, 2, 17, 8), _rand(1, 2, 17, 8)
    out = ref.pod_prefill_attention(q, k, k, v, torch.tensor([17]), sink=1, recent=3)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, dense)


@pytest.mark.parametrize("group", [1, 4])
def test_pod_decode_matches_prefill_last_row(group):
    b, hkv, d, n, sink, recent = 2, 2, 8, 30, 3, 6
    hq = hkv * group
    lens = torch.tensor([30, 11])
    ko, ka, v = _rand(b, hkv, n, d), _rand(b, hkv, n, d), _rand(b, hkv, n, d)
    q = _rand(b, hq, d)
    # build the sink + ring from the own keys
    k_local = torch.zeros(b, hkv, sink + recent, d, dtype=torch.float64)
    for bi in range(b):
        for j in range(int(lens[bi])):
            if j < sink:
                k_local[bi, :, j] = ko[bi, :, j]
            if j >= int(lens[bi]) - recent and j >= sink:
                k_local[bi, :, sink + j % recent] = ko[bi, :, j]
    out, gate = ref.pod_decode_attention(q, k_local, ka, v, lens, sink=sink, recent=recent, return_gate=True)
    for bi in range(b):
        L = int(lens[bi])
        qq = torch.zeros(1, hq, L, d, dtype=torch.float64)
        qq[0, :, L - 1] = q[bi]
        full, g = ref.pod_prefill_attention(qq, ko[bi:bi + 1, :, :L], ka[bi:bi + 1, :, :L], v[bi:bi + 1, :, :L],
                                            torch.tensor([L]), sink=sink, recent=recent, return_gate=True)
        torch.testing.assert_close(out[bi], full[0, :, L - 1])
        torch.testing.assert_close(gate[bi].double(), g[0, :, L - 1].double(), rtol=1e-5, atol=1e-6)
    # tau = tiny: every head skips distant keys -> attention over proximal positions only
    skipped = ref.pod_decode_attention(q, k_local, ka, v, lens, sink=sink, recent=recent, gate_tau=1e-9)
    L = 30
    prox = [j for j in range(L) if j < sink or L - 1 - j < recent]
    expect = _attend(q[0, 0], torch.stack([k_local[0, 0, j if j < sink else sink + j % recent] for j in prox]), v[0, 0, prox])
    torch.testing.assert_close(skipped[0, 0], expect)


def test_quest_scores_are_upper_bounds_and_select_current_page():
    b, hq, hkv, d, n, page = 2, 4, 2, 8, 45, 16
    q, k = _rand(b, hq, d), _rand(b, hkv, n, d)
    lens = torch.tensor([45, 20])
    mx, mn = ref.quest_page_minmax(k, lens, page)
    scores = ref.quest_page_scores(q, mx, mn, lens, page)
    for bi in range(b):
        L = int(lens[bi])
        for h in range(hq):
            for p in range(-(-L // page) - 1):
                true_max = (k[bi, h // 2, p * page: min((p + 1) * page, L)] @ q[bi, h]).max()
                assert scores[bi, h, p] >= true_max - 1e-5
            assert torch.isinf(scores[bi, h, -(-L // page) - 1]) and scores[bi, h, -(-L // page) - 1] > 0
    idx = ref.quest_select_pages(scores, lens, page, budget=32)
    assert idx.shape == (b, hq, 32)
    assert (idx[1] < 20).all()
    assert ((idx[1] >= 16) & (idx[1] < 20)).sum(-1).eq(4).all()  # current page, valid slots only


def test_fp32_fast_paths_match_the_explicit_fp64_math():
    """prefill_attention and pod_prefill_attention take an SDPA path in fp32 (no [S, S] logits)."""
    b, hq, hkv, s, d = 2, 6, 2, 33, 16
    q, k, ka, v = _rand(b, hq, s, d), _rand(b, hkv, s, d), _rand(b, hkv, s, d), _rand(b, hkv, s, d)
    lens = torch.tensor([33, 20])
    offs = torch.zeros(2, dtype=torch.long)
    exact = ref.prefill_attention(q, k, v, offs, lens)
    fast = ref.prefill_attention(q.float(), k.float(), v.float(), offs, lens)
    torch.testing.assert_close(fast.double(), exact, atol=1e-5, rtol=1e-5)
    exact = ref.pod_prefill_attention(q, k, ka, v, lens, sink=2, recent=7)
    qf = q.float().requires_grad_()
    fast = ref.pod_prefill_attention(qf, k.float(), ka.float(), v.float(), lens, sink=2, recent=7)
    torch.testing.assert_close(fast.double(), exact, atol=1e-5, rtol=1e-5)
    qd = q.clone().requires_grad_()
    ref.pod_prefill_attention(qd, k, ka, v, lens, sink=2, recent=7).square().sum().backward()
    fast.square().sum().backward()
    torch.testing.assert_close(qf.grad.double(), qd.grad, atol=1e-4, rtol=1e-4)
