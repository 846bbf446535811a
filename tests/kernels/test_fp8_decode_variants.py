"""Issue 32's FP8 full-decode variants (kernels/triton_decode_attention.FP8_DECODE_VARIANTS) equal the reference on
fresh random inputs, and the A/B script (benchmarks/plans/issue32_fp8_variants.py) refuses bad arguments.

CPU: interpreter, fp32 and fp16 q (the interpreter gets bf16 tl.dot wrong), plus bf16 q for the variants whose dots
both run in fp16 (cvt=3); ragged batches with a length-1 sequence and lengths that are not a multiple of any tile,
GQA groups 1 / 3 / 4 / 8, lengths across block boundaries; scales past seq_lens are NaN (must stay unread)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from kernel_checks import case_seed, error_check
from test_fp8_decode_attention import fp8_inputs, unread

from kernels import reference
from kernels.triton_decode_attention import FP8_DECODE_VARIANTS, decode_attention_triton, resolve_fp8_variant

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETING, reason="CPU cases run the Triton interpreter")
CASES = [  # B, Hq, Hkv, N, D, seq_lens
    (2, 4, 4, 300, 32, [300, 1]),          # G = 1, one sequence of only its own token
    (3, 6, 2, 270, 16, [1, 270, 129]),     # G = 3
    (2, 8, 2, 257, 64, [256, 193]),        # G = 4, one length exactly 2 tiles of 128
    (2, 8, 1, 520, 16, [520, 77]),         # G = 8, past a 256-key tile
]
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "plans", "issue32_fp8_variants.py")
assert_error_within = error_check(floor=1e-6)


def _dtypes(variant):
    cvt = FP8_DECODE_VARIANTS[variant]["cvt"]
    return [torch.float32, torch.float16] + ([torch.bfloat16] if cvt == 3 else [])


@pytest.mark.parametrize("variant", list(FP8_DECODE_VARIANTS))
@pytest.mark.parametrize("case", CASES)
def test_variant_matches_reference(variant, case, poisoned_outputs):
    for dtype in _dtypes(variant):
        q, _, (k8, v8, ks, vs), seq_lens = fp8_inputs(case, dtype, "cpu", case_seed(case, variant, dtype))
        out = decode_attention_triton(q, k8, v8, seq_lens, k_scale=unread(ks, seq_lens),
                                      v_scale=unread(vs, seq_lens), fp8_variant=variant)
        kw = dict(k_scale=ks, v_scale=vs)
        exact = reference.decode_attention(q.double(), k8, v8, seq_lens, **kw)
        ref = reference.decode_attention(q, k8, v8, seq_lens, **kw)
        assert out.dtype == dtype and not torch.isnan(out).any()
        if dtype == torch.bfloat16:
            # a bf16 output rounds once, and the fp16 dots' rounding (relative to the row's largest terms) can move
            # it by one bf16 ulp of the row's largest element (2^-7 relative), past 4x the reference's own error
            err = (out.double() - exact).abs().amax(-1)
            bound = 2.0 ** -7 * exact.abs().amax(-1) + 1e-6
            assert (err <= bound).all(), f"{variant}: {(err / bound).max():.2f}x one bf16 ulp of the row's amax"
        else:
            assert_error_within(f"{variant} {dtype}", out, ref, exact)


def test_env_var_selects_and_bad_names_raise(monkeypatch):
    monkeypatch.setenv("PODKIT_FP8_DECODE_VARIANT", "f16_vreg")
    assert resolve_fp8_variant() == FP8_DECODE_VARIANTS["f16_vreg"]
    assert resolve_fp8_variant("base") == FP8_DECODE_VARIANTS["base"]
    monkeypatch.setenv("PODKIT_FP8_DECODE_VARIANT", "nope")
    with pytest.raises(ValueError, match="PODKIT_FP8_DECODE_VARIANT"):
        resolve_fp8_variant()
    with pytest.raises(ValueError, match="fp8_variant"):
        resolve_fp8_variant("nope")


def test_default_is_base(monkeypatch):
    monkeypatch.delenv("PODKIT_FP8_DECODE_VARIANT", raising=False)
    assert resolve_fp8_variant() == dict(cvt=0, remask=0, block_n=64, num_warps=4, num_stages=2, waves=4)


def _load_script():
    """The A/B script as a module (its ``parse_args`` runs here, without a process per case)."""
    spec = importlib.util.spec_from_file_location("issue32_fp8_variants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args", [["--out", "x.json", "--contexts", "0"], ["--out", "x.json", "--batches", "-1"],
                                  ["--out", "x.json", "--variants", "nope"], ["--contexts", "1024"],
                                  ["--out", "/no/such/folder/x.json"], ["--out", "x.json", "--iters", "0"]])
def test_script_refuses_bad_arguments(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        _load_script().parse_args(args, tuple(FP8_DECODE_VARIANTS))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.strip().splitlines()[-1].startswith("issue32_fp8_variants.py: error:"), err
    assert not (tmp_path / "x.json").exists()


def test_script_command_line_exits_2_with_one_line(tmp_path):
    """The same refusal through the command line (the checks above run in this process)."""
    proc = subprocess.run([sys.executable, SCRIPT, "--out", "x.json", "--iters", "0"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("issue32_fp8_variants.py: error:"), proc.stderr
