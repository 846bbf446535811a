"""The Gluon sm_90 prefill kernel (kernels/gluon_prefill_attention_sm90.py) against the fp64 reference.

Gluon has no interpreter mode, so on CPU the kernel is compiled for sm_90 with Triton's bundled ptxas (it must
keep building where it cannot run) and the dispatch rules are checked; the numbers come from ``-m gpu`` on a
Hopper GPU: ragged batches (padding rows, an empty sequence, query offsets), GQA groups 1/3/4/8, D 64 and 128,
bf16 and fp16, every tile the launcher may use, and a 16K sequence against SDPA (races between the producer and
the consumer warp groups only show once many tiles pass through the shared-memory ring).
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, error_check

from kernels import gluon_prefill_attention_sm90 as gluon_prefill
from kernels import reference
from kernels.triton_prefill_attention import prefill_attention_triton

assert_error_within = error_check(floor=1e-5)
H100_SHARED_MEMORY = 232448  # bytes a block may opt in to on sm_90


def _on_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernel runs on sm_90 only")


COMPILE_SCRIPT = """
import json, sys, torch
from kernels.gluon_prefill_attention_sm90 import compile_for_sm90
compiled = compile_for_sm90(head_dim=int(sys.argv[1]), dtype=getattr(torch, sys.argv[2]), group=4)
ptx = compiled.asm["ptx"]
found = [i for i in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait") if i in ptx]
print(json.dumps({"shared": compiled.metadata.shared, "found": found}))
"""


@pytest.mark.parametrize("head_dim, dtype", [(128, "bfloat16"), (64, "float16")])
def test_compiles_for_sm90(head_dim, dtype):
    """The default tile builds to sm_90a code that uses what the kernel is for (wgmma, TMA, register handover
    between the producer and the consumers) and fits the shared memory of a Hopper block. In a process of its
    own: under TRITON_INTERPRET (the CPU tests) Triton's JIT wraps kernels for the interpreter, not the compiler."""
    import json
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(head_dim), dtype], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["found"] == ["wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait"]
    assert result["shared"] <= H100_SHARED_MEMORY


def test_kernel_choice_env(monkeypatch):
    monkeypatch.setenv(gluon_prefill.KERNEL_ENV, "cudnn")
    with pytest.raises(ValueError, match="PODKIT_PREFILL_KERNEL='cudnn'; allowed: auto, gluon, triton"):
        gluon_prefill.kernel_choice()
    monkeypatch.setenv(gluon_prefill.KERNEL_ENV, " Triton ")
    assert gluon_prefill.kernel_choice() == "triton"
    monkeypatch.delenv(gluon_prefill.KERNEL_ENV)
    assert gluon_prefill.kernel_choice() == "auto"


def test_unsupported_calls_take_the_triton_kernel(monkeypatch):
    q = torch.zeros(1, 4, 8, 64)
    k = torch.zeros(1, 2, 8, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "not a Hopper" in gluon_prefill.unsupported_reason(q, k, k)  # CPU tensors, on any machine
    assert not gluon_prefill.use_gluon_kernel(q, k, k)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in gluon_prefill.unsupported_reason(q, k, k)
    monkeypatch.setenv(gluon_prefill.KERNEL_ENV, "gluon")
    with pytest.raises(ValueError, match="PODKIT_PREFILL_KERNEL=gluon, but this call cannot run"):
        gluon_prefill.use_gluon_kernel(q, k, k)
    monkeypatch.setenv(gluon_prefill.KERNEL_ENV, "triton")
    assert not gluon_prefill.use_gluon_kernel(q, k, k)


def test_gluon_inputs_copies_only_what_is_not_contiguous(monkeypatch):
    """The dispatch on a (pretended) Hopper device: the engine's [B, S, H, D]-viewed q/k/v are made contiguous for
    the descriptors, contiguous ones pass as they are, ineligible calls get None (the tl.dot kernel)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(gluon_prefill, "_is_hopper", lambda device: True)
    q = torch.randn(2, 40, 8, 64, dtype=torch.bfloat16).transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
    k = torch.randn(2, 40, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 2, 40, 64, dtype=torch.bfloat16)
    got = gluon_prefill.gluon_inputs(q, k, v)
    assert got is not None and all(t.is_contiguous() for t in got)
    assert torch.equal(got[0], q) and torch.equal(got[1], k) and got[2] is v
    assert gluon_prefill.gluon_inputs(q.float(), k.float(), v.float()) is None
    assert gluon_prefill.gluon_inputs(q, torch.cat([k, k], 2), torch.cat([v, v], 2)) is None  # N != S
    monkeypatch.setenv(gluon_prefill.KERNEL_ENV, "triton")
    assert gluon_prefill.gluon_inputs(q, k, v) is None
    monkeypatch.setenv(gluon_prefill.KERNEL_ENV, "gluon")
    with pytest.raises(ValueError, match="dtype torch.float32; allowed: torch.bfloat16, torch.float16"):
        gluon_prefill.gluon_inputs(q.float(), k.float(), v.float())


@needs_hopper
@pytest.mark.gpu
def test_reasons_on_hopper():
    q = torch.zeros(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    assert gluon_prefill.unsupported_reason(q, k, k) is None
    assert "fresh-prefill layout" in gluon_prefill.unsupported_reason(q, torch.cat([k, k], 2), torch.cat([k, k], 2))
    assert "dtype" in gluon_prefill.unsupported_reason(q.float(), k.float(), k.float())
    assert "head dim" in gluon_prefill.unsupported_reason(q[..., :96], k[..., :96], k[..., :96])
    assert "contiguous" in gluon_prefill.unsupported_reason(q.transpose(1, 2).contiguous().transpose(1, 2), k, k)


def _ragged_case(group, head_dim, dtype, seed, seq=700):
    """3 sequences of ``seq`` slots: one full, one ending at 513 (padding rows), one empty with a query offset."""
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    q = torch.randn(3, hkv * group, seq, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(3, hkv, seq, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(3, hkv, seq, head_dim, generator=gen).to(DEVICE, dtype)
    q_offsets = torch.tensor([0, 0, 37], device=DEVICE, dtype=torch.int32)
    kv_lens = torch.tensor([seq, 513, 0], device=DEVICE, dtype=torch.int32)
    return q, k, v, q_offsets, kv_lens


def _launch(q, k, v, q_offsets, kv_lens, tile=None):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device)
    gluon_prefill.launch_prefill_kernel_sm90(q, k, v, out, lse, q_offsets, kv_lens, q.shape[1] // k.shape[1],
                                             q.shape[-1] ** -0.5, True, tile=tile)
    return out, lse


def _assert_matches_exact(out, lse, q, k, v, q_offsets, kv_lens):
    exact_out, exact_lse = reference.prefill_attention(q.double(), k.double(), v.double(), q_offsets, kv_lens,
                                                       return_lse=True)
    ref_out = reference.prefill_attention(q, k, v, q_offsets, kv_lens)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten or NaN outputs"
    assert_error_within("out", out, ref_out, exact_out, factor=3.0)
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isinf(lse), ~finite), "padding rows must have lse = -inf"
    assert (lse[finite].double() - exact_lse[finite]).abs().max().item() < 1e-2
    assert (out[~finite] == 0).all(), "rows at positions >= kv_lens must be 0"


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("group, head_dim, dtype", [
    (1, 128, torch.bfloat16), (3, 128, torch.bfloat16), (4, 128, torch.float16), (8, 128, torch.bfloat16),
    (4, 64, torch.bfloat16), (1, 64, torch.float16),
])
def test_ragged_batch_gpu(group, head_dim, dtype):
    case = _ragged_case(group, head_dim, dtype, seed=group * head_dim)
    _assert_matches_exact(*_launch(*case), *case)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(128, 128, 3, 4, 2), (128, 64, 4, 4, 2), (128, 128, 3, 8, 1), (128, 64, 4, 8, 1)],
                         ids=lambda t: "m{}_n{}_s{}_w{}_c{}".format(*t))
def test_every_tile_gpu(tile):
    """Both consumer arrangements (two 4-warp partitions, the default; one 8-warp partition) and both key tiles,
    on a length that ends inside a query tile and a key tile (700 = 5 x 128 + 60)."""
    case = _ragged_case(4, 128, torch.bfloat16, seed=sum(tile))
    _assert_matches_exact(*_launch(*case, tile=tile), *case)


@needs_hopper
@pytest.mark.gpu
def test_long_sequence_against_sdpa_gpu():
    """16K keys stream 128 tiles through the 3-slot ring per program: a slot released too early shows here."""
    gen = torch.Generator().manual_seed(16)
    q = torch.randn(1, 4, 16384, 128, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(1, 1, 16384, 128, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(1, 1, 16384, 128, generator=gen).to(DEVICE, torch.bfloat16)
    zeros = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    lens = torch.full((1,), 16384, dtype=torch.int32, device=DEVICE)
    out, _ = _launch(q, k, v, zeros, lens)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert_error_within("out", out, sdpa, exact, factor=3.0)


@needs_hopper
@pytest.mark.gpu
def test_prefill_attention_takes_it_on_hopper(monkeypatch):
    """prefill_attention_triton routes an eligible call to the Gluon kernel (and PODKIT_PREFILL_KERNEL=triton
    away from it); both answers agree."""
    import kernels.triton_prefill_attention as prefill

    calls = []
    real = prefill.launch_prefill_kernel_sm90
    monkeypatch.setattr(prefill, "launch_prefill_kernel_sm90", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, q_offsets, kv_lens = _ragged_case(4, 128, torch.bfloat16, seed=5)
    with torch.no_grad():
        out_gluon, lse_gluon = prefill_attention_triton(q, k, v, q_offsets, kv_lens, return_lse=True)
        assert calls == [1]
        monkeypatch.setenv(gluon_prefill.KERNEL_ENV, "triton")
        out_triton, lse_triton = prefill_attention_triton(q, k, v, q_offsets, kv_lens, return_lse=True)
        assert calls == [1]
    assert (out_gluon.float() - out_triton.float()).abs().max().item() < 2e-2
    finite = torch.isfinite(lse_triton)
    assert torch.equal(finite, torch.isfinite(lse_gluon))
    assert (lse_gluon[finite] - lse_triton[finite]).abs().max().item() < 1e-3
