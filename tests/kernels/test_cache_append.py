"""Triton ``append_kv`` (one launch writes a decode token's keys and values into a static cache) against
``kernels.reference.append_kv``. CPU: interpreter, fp32 / fp16; GPU (``-m gpu``): bf16. Buffers are random
(so an untouched slot that changed shows), batches smaller than the buffer, strided views of a bigger pool,
head dims that are not powers of two, GQA head counts 1 / 3 / 4 / 8."""

import os

import pytest
import torch
from kernel_checks import case_seed

from kernels import fp8_kv, reference
from kernels.triton_cache_append import append_kv_triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")

CASES = [  # Bmax, B, Hkv, N, D
    (4, 3, 1, 50, 64),
    (2, 2, 3, 17, 80),   # D not a power of two
    (5, 1, 4, 33, 16),
    (3, 3, 8, 40, 128),
]


def make_case(case, dtype, device, seed, pool_heads=0):
    bmax, batch, heads, capacity, dim = case
    gen = torch.Generator().manual_seed(seed)
    # a view into a bigger pool (POD's key_pool layout) when pool_heads > 0: non-contiguous batch / head strides
    total = heads + pool_heads
    pool = torch.randn(bmax, total, capacity, dim, generator=gen).to(device, dtype)
    keys = pool[:, pool_heads:pool_heads + heads]
    values = torch.randn(bmax, heads, capacity, dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, heads, dim, generator=gen).to(device, dtype)
    positions = torch.randperm(capacity, generator=gen)[:batch].to(device)
    return keys, values, k, v, positions


def run_both(case, dtype, device, seed, pool_heads=0):
    keys, values, k, v, positions = make_case(case, dtype, device, seed, pool_heads)
    ref_keys, ref_values = keys.clone(), values.clone()
    reference.append_kv(ref_keys, ref_values, k, v, positions)
    append_kv_triton(keys, values, k, v, positions)
    return keys, values, ref_keys, ref_values, k, v, positions


@cpu_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pool_heads", [0, 2])
def test_append_matches_reference_cpu(case, dtype, pool_heads):
    keys, values, ref_keys, ref_values, k, v, positions = run_both(case, dtype, "cpu", seed=case_seed(case),
                                                                    pool_heads=pool_heads)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    rows = torch.arange(k.shape[0])
    assert torch.equal(keys[rows, :, positions], k) and torch.equal(values[rows, :, positions], v)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pool_heads", [0, 2])
def test_append_matches_reference_gpu(case, pool_heads):
    keys, values, ref_keys, ref_values, *_ = run_both(case, torch.bfloat16, "cuda", seed=7, pool_heads=pool_heads)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


def test_reference_changes_only_the_written_slots():
    keys, values, k, v, positions = make_case((3, 2, 2, 9, 8), torch.float32, "cpu", seed=1)
    before_k, before_v = keys.clone(), values.clone()
    reference.append_kv(keys, values, k, v, positions)
    changed = (keys != before_k).any(-1) | (values != before_v).any(-1)   # [Bmax, H, N]
    expected = torch.zeros_like(changed)
    expected[torch.arange(2), :, positions] = True
    assert torch.equal(changed, expected)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(k=a["k"][:, :1]), r"k must be \[B <= 3, 2, 8\]"),
    (lambda a: a.update(value_buffer=a["value_buffer"][:, :, :4]), "value_buffer shape"),
    (lambda a: a.update(positions=a["positions"].float()), "positions must be an int32 / int64"),
    (lambda a: a.update(positions=a["positions"] + 100), r"positions must be slots in \[0, N=9\)"),
])
def test_bad_arguments_are_named(mutate, message):
    keys, values, k, v, positions = make_case((3, 2, 2, 9, 8), torch.float32, "cpu", seed=2)
    args = dict(key_buffer=keys, value_buffer=values, k=k, v=v, positions=positions)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        reference.append_kv(**args)


def make_pod_case(case, dtype, device, seed, sink=2, recent=5):
    """POD's layout: keys in a pool with rows for the anchor heads only (key_heads maps head -> row, -1 = none),
    and a ring of proximal keys; every buffer random so that any stray write shows."""
    bmax, batch, heads, capacity, dim = case
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(heads + 2, generator=gen)[:heads]
    key_heads = torch.where(torch.arange(heads) % 2 == 1, torch.full_like(rows, -1), rows).to(torch.int32)
    pool = torch.randn(bmax, heads + 2, capacity, dim, generator=gen).to(device, dtype)
    values = torch.randn(bmax, heads, capacity, dim, generator=gen).to(device, dtype)
    ring = torch.randn(bmax, heads, sink + recent, dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, heads, dim, generator=gen).to(device, dtype)
    positions = torch.randperm(capacity, generator=gen)[:batch].to(device)
    positions[0] = 1  # a sink position (slot 1), the others land in the ring (sink + p % recent)
    return pool, values, k, v, positions, key_heads.to(device), ring, sink, recent


def run_pod_both(case, dtype, device, seed):
    pool, values, k, v, positions, key_heads, ring, sink, recent = make_pod_case(case, dtype, device, seed)
    ref = [t.clone() for t in (pool, values, ring)]
    kw = dict(key_heads=key_heads, ring=ring, sink=sink, recent=recent)
    reference.append_kv(ref[0], ref[1], k, v, positions, **dict(kw, ring=ref[2]))
    append_kv_triton(pool, values, k, v, positions, **kw)
    return (pool, values, ring), ref, (k, v, positions, key_heads, sink, recent)


@cpu_only
@pytest.mark.parametrize("case", CASES)
def test_pod_layout_append_matches_reference_cpu(case):
    got, ref, (k, v, positions, key_heads, sink, recent) = run_pod_both(case, torch.float32, "cpu", seed=5)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    pool, values, ring = got
    b = torch.arange(k.shape[0])
    assert torch.equal(values[b, :, positions], v)
    for h, row in enumerate(key_heads.tolist()):
        if row >= 0:
            assert torch.equal(pool[b, row, positions], k[:, h])
    slots = torch.where(positions < sink, positions, sink + positions % recent)
    assert torch.equal(ring[b, :, slots], k)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_pod_layout_append_matches_reference_gpu(case):
    got, ref, _ = run_pod_both(case, torch.bfloat16, "cuda", seed=8)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_reference_pod_layout_changes_only_the_written_slots():
    pool, values, k, v, positions, key_heads, ring, sink, recent = make_pod_case((3, 2, 4, 12, 8), torch.float32,
                                                                                "cpu", seed=3)
    before = [t.clone() for t in (pool, values, ring)]
    reference.append_kv(pool, values, k, v, positions, key_heads=key_heads, ring=ring, sink=sink, recent=recent)
    changed = [(a != b).any(-1) for a, b in zip((pool, values, ring), before)]  # [Bmax, rows, slots]
    b = torch.arange(2)
    expect_pool = torch.zeros_like(changed[0])
    for h, row in enumerate(key_heads.tolist()):
        if row >= 0:
            expect_pool[b, row, positions] = True
    expect_values = torch.zeros_like(changed[1])
    expect_values[b, :, positions] = True
    expect_ring = torch.zeros_like(changed[2])
    expect_ring[b, :, torch.where(positions < sink, positions, sink + positions % recent)] = True
    assert torch.equal(changed[0], expect_pool) and torch.equal(changed[1], expect_values)
    assert torch.equal(changed[2], expect_ring)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(key_heads=a["key_heads"][:2]), r"key_heads must be an int32 / int64 \[Hkv=4\]"),
    (lambda a: a.update(key_heads=a["key_heads"] + 9), r"key_heads must be rows in \[-1, U=6\)"),
    (lambda a: a.update(ring=a["ring"][:, :, :3]), r"ring must be \[Bmax=3, Hkv=4, sink \+ recent=7, D=8\]"),
    (lambda a: a.update(recent=0), "sink=2 and recent=0"),
])
def test_bad_pod_layout_arguments_are_named(mutate, message):
    pool, values, k, v, positions, key_heads, ring, sink, recent = make_pod_case((3, 2, 4, 12, 8), torch.float32,
                                                                                "cpu", seed=4)
    args = dict(key_buffer=pool, value_buffer=values, k=k, v=v, positions=positions, key_heads=key_heads,
                ring=ring, sink=sink, recent=recent)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        reference.append_kv(**args)


# ---------------------------------------------------------------------------------------------
# FP8 caches (kernels/fp8_kv.py): the kernel quantises in registers, byte-equal to the reference
# ---------------------------------------------------------------------------------------------

def fp8_buffers(*buffers):
    """FP8 copies of float buffers (random bytes kept, so a stray write shows) and random fp32 scales."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in buffers:
        out.append((t.clamp(-448, 448).to(torch.float8_e4m3fn), torch.rand(t.shape[:-1], generator=gen).to(t.device)))
    return out


def assert_same_bytes(got, want):
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def append_fp8_both(keys, values, k, v, positions):
    """Append into FP8 copies of the buffers with the kernel and the reference; the bytes and scales must be equal.
    Returns the kernel's (key bytes, key scales)."""
    (kb, ks), (vb, vs) = fp8_buffers(keys, values)
    ref = [t.clone() for t in (kb, vb, ks, vs)]
    reference.append_kv(ref[0], ref[1], k, v, positions, key_scale=ref[2], value_scale=ref[3])
    append_kv_triton(kb, vb, k, v, positions, key_scale=ks, value_scale=vs)
    for got, want in zip((kb, vb), ref[:2]):
        assert_same_bytes(got, want)
    assert torch.equal(ks, ref[2]) and torch.equal(vs, ref[3])
    return kb, ks


@cpu_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_append_matches_reference_cpu(case, dtype):
    keys, values, k, v, positions = make_case(case, torch.float32, "cpu", case_seed(case, "fp8"), pool_heads=2)
    k, v = k.to(dtype), v.to(dtype)
    k[0, 0] = 0.0  # an all-zero token: the scale floor, bytes 0
    kb, ks = append_fp8_both(keys, values, k, v, positions)
    rows = torch.arange(k.shape[0])
    data, scale = fp8_kv.quantize_kv(k)
    assert_same_bytes(kb[rows, :, positions], data)
    assert torch.equal(ks[rows, :, positions], scale)


@cpu_only
@pytest.mark.parametrize("case", CASES[:2])
def test_fp8_pod_layout_append_matches_reference_cpu(case):
    pool, values, k, v, positions, key_heads, ring, sink, recent = make_pod_case(case, torch.float32, "cpu", seed=6)
    (pb, ps), (vb, vs), (rb, rs) = fp8_buffers(pool, values, ring)
    got = [pb, vb, rb, ps, vs, rs]
    ref = [t.clone() for t in got]
    kw = dict(key_heads=key_heads, sink=sink, recent=recent)
    reference.append_kv(ref[0], ref[1], k, v, positions, ring=ref[2], key_scale=ref[3], value_scale=ref[4],
                        ring_scale=ref[5], **kw)
    append_kv_triton(pb, vb, k, v, positions, ring=rb, key_scale=ps, value_scale=vs, ring_scale=rs, **kw)
    for a, b in zip(got[:3], ref[:3]):
        assert_same_bytes(a, b)
    for a, b in zip(got[3:], ref[3:]):
        assert torch.equal(a, b)


@cpu_only
def test_fp8_rounding_matches_torch_on_every_regime():
    """Ties, subnormals, the largest value, signed zeros: the kernel's software RTNE equals torch's cast."""
    ties = torch.tensor([1.0625, 1.1875, 2 ** -9 * 1.5, 2 ** -9 * 0.5, 2 ** -6 * 1.0625, 2 ** -10, 448.0, -0.0])
    k = torch.cat([ties, torch.linspace(-448, 448, 120)]).view(1, 1, 128)  # amax 448: scale 1, rounded as given
    kb, vb = torch.zeros(1, 1, 2, 128, dtype=torch.float8_e4m3fn), torch.zeros(1, 1, 2, 128, dtype=torch.float8_e4m3fn)
    ks, vs = torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)
    append_kv_triton(kb, vb, k, k, torch.tensor([1]), key_scale=ks, value_scale=vs)
    assert ks[0, 0, 1] == 1.0
    assert_same_bytes(kb[0, 0, 1], k[0, 0].to(torch.float8_e4m3fn))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_fp8_append_matches_reference_gpu(case):
    append_fp8_both(*make_case(case, torch.bfloat16, "cuda", seed=9))


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(key_scale=None), "key_buffer is float8_e4m3fn but key_scale is None"),
    (lambda a: a.update(value_scale=a["value_scale"].half()), "value_scale must be a float32 tensor"),
    (lambda a: a.update(key_scale=a["key_scale"][:, :, :4]), r"key_scale shape \(3, 2, 4\) must be \(3, 2, 9\)"),
    (lambda a: a.update(value_buffer=a["value_buffer"].float(), value_scale=None), "must all be float8_e4m3fn"),
])
def test_bad_fp8_arguments_are_named(mutate, message):
    keys, values, k, v, positions = make_case((3, 2, 2, 9, 8), torch.float32, "cpu", seed=2)
    (kb, ks), (vb, vs) = fp8_buffers(keys, values)
    args = dict(key_buffer=kb, value_buffer=vb, k=k, v=v, positions=positions, key_scale=ks, value_scale=vs)
    mutate(args)
    for fn in (reference.append_kv, append_kv_triton):
        with pytest.raises((ValueError, TypeError), match=message):
            fn(**args)
