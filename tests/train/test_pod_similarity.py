"""POD exploration math: attention rows, JS similarity, greedy grouping, KV saving, blocks JSON."""

import json
import math

import pytest
import torch

from sparse_models.calibration import pod_similarity as ps


def _brute_rows(q_last, k, seq_lens):
    batch, num_heads, num_queries, dim = q_last.shape
    group = num_heads // k.shape[1]
    out = torch.full((batch, num_heads, num_queries, k.shape[2]), float("nan"), dtype=torch.float64)
    for b in range(batch):
        for h in range(num_heads):
            for i in range(num_queries):
                pos = int(seq_lens[b]) - num_queries + i
                logits = torch.full((k.shape[2],), float("-inf"), dtype=torch.float64)
                for j in range(pos + 1):
                    logits[j] = (q_last[b, h, i].double() @ k[b, h // group, j].double()) / math.sqrt(dim)
                out[b, h, i] = torch.softmax(logits, 0)
    return out


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_attention_rows_match_brute_force_ragged(group):
    num_kv, dim, seq, num_queries = 2, 8, 37, 5
    q = torch.randn(3, num_kv * group, num_queries, dim)
    k = torch.randn(3, num_kv, seq, dim)
    seq_lens = torch.tensor([37, 20, 5])
    rows = ps.attention_rows(q, k, seq_lens)
    expected = _brute_rows(q, k, seq_lens)
    torch.testing.assert_close(rows.double(), expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(rows.sum(-1), torch.ones(()), atol=1e-5)
    assert rows[1, :, :, 20:].abs().max() == 0  # padding slots get no mass


def test_attention_rows_rejects_bad_shapes():
    with pytest.raises(ValueError, match="seq_lens"):
        ps.attention_rows(torch.randn(1, 2, 4, 8), torch.randn(1, 1, 10, 8), torch.tensor([3]))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ps.attention_rows(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 10, 8))


def test_js_similarity_properties():
    p = torch.softmax(torch.randn(6, 50), -1)
    r = torch.softmax(torch.randn(6, 50), -1)
    sim = ps.js_similarity(p, r)
    torch.testing.assert_close(sim, ps.js_similarity(r, p))
    torch.testing.assert_close(ps.js_similarity(p, p), torch.ones(6))
    assert bool(((sim >= 0) & (sim < 1)).all())
    disjoint_a = torch.tensor([1.0, 0.0, 0.0, 0.0])
    disjoint_b = torch.tensor([0.0, 0.0, 0.5, 0.5])
    assert float(ps.js_similarity(disjoint_a, disjoint_b)) == pytest.approx(0.0, abs=1e-6)  # base 2: JSD = 1
    # Against scipy-free closed form: JSD of two two-point distributions.
    a, b = torch.tensor([0.9, 0.1]), torch.tensor([0.3, 0.7])
    m = (a + b) / 2
    kl = lambda x, y: float((x * torch.log2(x / y)).sum())  # noqa: E731
    assert float(ps.js_similarity(a, b)) == pytest.approx(1 - 0.5 * kl(a, m) - 0.5 * kl(b, m), abs=1e-6)


def test_accumulator_averages_query_heads_per_kv_head():
    num_layers, batch, group, num_kv, num_queries, seq = 3, 2, 3, 2, 4, 11
    rows = [torch.softmax(torch.randn(batch, group * num_kv, num_queries, seq), -1) for _ in range(num_layers)]
    acc = ps.LayerSimilarityAccumulator(num_layers, num_kv)
    acc.add(rows[:])
    acc.add([r.flip(0) for r in rows])  # same samples again: the mean is unchanged
    sim = acc.similarity()
    assert sim.shape == (num_kv, num_layers, num_layers)
    for head in range(num_kv):
        heads = slice(head * group, (head + 1) * group)
        expected = ps.js_similarity(rows[0][:, heads], rows[2][:, heads]).mean()
        assert float(sim[head, 0, 2]) == pytest.approx(float(expected), abs=1e-5)
        assert float(sim[head, 2, 0]) == pytest.approx(float(expected), abs=1e-5)
        assert float(sim[head, 1, 1]) == pytest.approx(1.0)


@pytest.mark.parametrize("chunk_layers", [1, 2, 10])
def test_accumulator_every_pair_across_chunks(monkeypatch, chunk_layers):
    num_layers, batch, group, num_kv, num_queries, seq = 5, 2, 4, 2, 3, 13
    rows = [torch.softmax(3 * torch.randn(batch, group * num_kv, num_queries, seq), -1) for _ in range(num_layers)]
    copies = [r.clone() for r in rows]
    monkeypatch.setattr(ps.LayerSimilarityAccumulator, "CHUNK_ELEMENTS", chunk_layers * rows[0].numel())
    acc = ps.LayerSimilarityAccumulator(num_layers, num_kv)
    acc.add(rows)
    sim = acc.similarity()
    assert all(torch.equal(r, c) for r, c in zip(rows, copies))  # inputs untouched
    for head in range(num_kv):
        heads = slice(head * group, (head + 1) * group)
        for a in range(num_layers):
            for b in range(num_layers):
                expected = ps.js_similarity(rows[a][:, heads], rows[b][:, heads]).mean()
                assert float(sim[head, a, b]) == pytest.approx(float(expected), abs=1e-5), (head, a, b)


def test_greedy_blocks_anchor_vs_previous():
    # Layer 2 is similar to layer 1 but not to the anchor 0: the two readings differ there.
    sim = torch.eye(4).unsqueeze(0).repeat(2, 1, 1)
    s = sim[0]
    s[0, 1] = s[1, 0] = 0.9
    s[1, 2] = s[2, 1] = 0.8
    s[0, 2] = s[2, 0] = 0.3
    s[2, 3] = s[3, 2] = 0.7
    s[0, 3] = s[3, 0] = 0.1
    sim[1] = 1.0  # head 1: everything similar -> one block
    assert ps.greedy_blocks(sim, 0.5, "anchor") == [[0, 0], [0, 0], [2, 0], [2, 0]]
    assert ps.greedy_blocks(sim, 0.5, "previous") == [[0, 0], [0, 0], [0, 0], [0, 0]]
    assert ps.greedy_blocks(sim, 1.0, "anchor") == [[0, 0], [1, 0], [2, 0], [3, 0]]
    assert ps.greedy_blocks(sim, 0.0, "anchor") == [[0, 0]] * 4
    with pytest.raises(ValueError, match="delta"):
        ps.greedy_blocks(sim, 1.5)
    with pytest.raises(ValueError, match="compare_with"):
        ps.greedy_blocks(sim, 0.5, "neighbour")


def test_blocks_and_kv_saving():
    anchors = [[0, 0], [0, 1], [0, 1], [3, 1]]
    assert ps.blocks_per_head(anchors) == [[[0, 2], [3, 3]], [[0, 0], [1, 3]]]
    # 8 units, 3 non-anchor... count: anchors are (0,0),(0,1),(1,1),(3,0) -> 4 anchors, 4 shared.
    seq, sink, recent = 1000, 10, 90
    expected = 1 - (4 * 2 * seq + 4 * (seq + sink + recent)) / (8 * 2 * seq)
    assert ps.kv_saving_fraction(anchors, seq, sink, recent) == pytest.approx(expected)
    assert ps.kv_saving_fraction([[0]], seq, sink, recent) == 0.0
    assert ps.kv_saving_fraction(anchors, 50, sink, recent) == 0.0  # everything proximal


def test_explore_end_to_end_and_json(tmp_path):
    num_layers, num_kv, group, dim, seq = 4, 2, 2, 8, 24
    keys = [torch.randn(1, num_kv, seq, dim) for _ in range(num_layers)]
    keys[1] = keys[0] + 0.01 * torch.randn_like(keys[0])  # layer 1 attends like layer 0

    def capture(ids):
        q = torch.randn(ids.shape[0], num_kv * group, seq, dim, generator=torch.Generator().manual_seed(1))
        return {layer: (q, keys[layer].expand(ids.shape[0], -1, -1, -1)) for layer in range(num_layers)}

    samples = [torch.zeros(2, seq, dtype=torch.long), torch.zeros(1, seq, dtype=torch.long)]
    result = ps.explore(samples, capture, num_layers=num_layers, num_kv_heads=num_kv, last_queries=6, delta=0.9)
    assert result["samples"] == 3
    assert all(row[0] == 0 for row in result["anchor_layers"][:2])  # layer 1 joins layer 0's block
    assert float(result["similarity"][:, 0, 1].min()) > 0.99
    path = ps.write_blocks_json(tmp_path / "blocks.json", result["anchor_layers"], result["similarity"], delta=0.9)
    data = ps.read_blocks_json(path)
    assert data["anchor_layers"] == result["anchor_layers"] and data["delta"] == 0.9
    assert len(data["similarity"]) == num_kv
    png = ps.plot_similarity_heatmap(result["similarity"], result["anchor_layers"], tmp_path / "sim.png")
    assert png.stat().st_size > 1000
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"anchor_layers": [[0], [2]]}))
    with pytest.raises(Exception, match="anchor_layers"):
        ps.read_blocks_json(bad)
