"""``python -m eval.bench decode-profile``: kernel names sorted into kinds, the step split into busy / gap and
categories against their byte floors, and the tiny CPU run end to end (the numbers themselves come from the GPU)."""

import json

import pytest

from eval.bench.decode_profile import categorize, main, summarize


@pytest.mark.parametrize("name, category", [
    ("_decode_split_kernel", "attention"),
    ("_merge_splits_kernel", "attention"),
    ("pod_sparse_decode_kernel", "attention"),
    ("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", "matrix products"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "matrix products"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16>", "matrix products"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms"),
    ("triton_poi_fused_apply_rotary_pos_emb_cat_mul_1", "rope"),
    ("void at::native::index_copy_kernel_impl", "kv cache write"),
    ("void at::native::(anonymous namespace)::indexSelectSmallIndex", "embedding / sampling"),
    ("triton_poi_fused_mul_silu_2", "fused elementwise"),
    ("void at::native::unrolled_elementwise_kernel<...>", "fused elementwise"),
    ("_decode_linear_kernel", "matrix products"),
    ("_append_kv_kernel", "kv cache write"),
    ("triton_red_fused__to_copy_add_decode_linear_mean_mul_pow_rsqrt_view_0", "norms"),
    ("cudaStreamSynchronize", "other"),
])
def test_kernel_names_fall_into_their_kind(name, category):
    assert categorize(name) == category


def test_summarize_splits_the_step_and_compares_with_floors():
    kernels = [{"name": "gemm_a", "ms_per_step": 3.0, "calls_per_step": 224, "category": "matrix products"},
               {"name": "_decode_split_kernel", "ms_per_step": 1.5, "calls_per_step": 32, "category": "attention"},
               {"name": "triton_red_rsqrt", "ms_per_step": 0.5, "calls_per_step": 65, "category": "norms"}]
    summary = summarize(kernels, step_ms=6.0, floors_ms={"weights": 2.5, "kv": 1.0})
    assert summary["busy_ms"] == pytest.approx(5.0) and summary["gap_ms"] == pytest.approx(1.0)
    assert summary["kernels_per_step"] == 321
    cats = summary["categories"]
    assert list(cats) == ["matrix products", "attention", "norms"]  # largest first
    assert cats["matrix products"]["ratio_to_floor"] == pytest.approx(1.2)
    assert cats["attention"]["ratio_to_floor"] == pytest.approx(1.5)
    assert "ratio_to_floor" not in cats["norms"] and cats["norms"]["share_of_step"] == pytest.approx(0.5 / 6)


def test_tiny_run_writes_json_and_table(tmp_path, monkeypatch):
    # main() skips the kernels' value checks for the whole process (as e2e does); keep that out of later tests
    monkeypatch.setenv("PODKIT_SKIP_VALUE_CHECKS", "1")
    out = tmp_path / "profile.json"
    assert main(["--tiny", "--rows", "128x2", "--timed-steps", "2", "--profile-steps", "1", "--schemes", "podkit-dense",
                 "tidal", "--decode-kernels", "standard", "fused", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    row = result["rows"]["128x2"]
    assert set(row) == {"podkit-dense standard graph", "podkit-dense fused graph", "tidal standard graph",
                        "tidal fused graph"}
    for summary in row.values():
        assert summary["busy_ms"] > 0 and summary["step_ms"] > 0 and summary["kernels_per_step"] > 0
        assert "matrix products" in summary["categories"] and summary["top_kernels"]
    assert "| 128x2 | tidal fused graph |" in out.with_suffix(".md").read_text()


def test_bad_step_counts_are_refused():
    with pytest.raises(SystemExit):
        main(["--tiny", "--profile-steps", "0"])


def test_an_unknown_scheme_is_refused_before_any_work(tmp_path):
    with pytest.raises(Exception, match="bogus"):
        main(["--tiny", "--schemes", "bogus", "--out", str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()
