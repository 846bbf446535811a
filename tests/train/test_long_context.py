"""Tiled MLP and checkpoint offload (train/long_context.py, DeepSpeed's ALST components): the same loss,
logits and gradients as the plain model, on a tiny POD model, with and without gradient checkpointing."""

import copy

import pytest
import torch

pytest.importorskip("deepspeed", reason="tiled MLP and checkpoint offload are DeepSpeed's (ALST)")

from sp_helpers import VOCAB, tiny_pod_model  # noqa: E402

from train.long_context import (  # noqa: E402
    CheckpointOffload,
    attach_checkpoint_offload,
    default_mlp_shards,
    disable_tiled_mlp,
    enable_tiled_mlp,
)

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 6, 2, 8  # hidden = 48
SEQ = 401  # > 2 * 4 * hidden: the automatic rule cuts 3 slices, the last one shorter


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


def _assert_same(a, b):
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6, msg=name)


def _model_and_ids(checkpointing: bool):
    model = tiny_pod_model(HEADS, KV_HEADS, layers=LAYERS, head_dim=HEAD_DIM, seed=3).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return model, ids


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("shards", [None, 4])
def test_tiled_mlp_equals_untiled(checkpointing, shards, monkeypatch):
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    model, ids = _model_and_ids(checkpointing)
    plain = _run(model, ids)
    calls = []
    real_apply = ulysses_sp.TiledMLP.apply
    monkeypatch.setattr(ulysses_sp.TiledMLP, "apply", lambda *a: calls.append(a[3]) or real_apply(*a))
    expected = 4 if shards else 3  # ceil(401 / (4 * 48))
    assert enable_tiled_mlp(model, SEQ, shards) == expected
    tiled = _run(model, ids)
    # once per layer in the forward, and again in the backward's recomputation with checkpointing
    assert calls == [expected] * LAYERS * (2 if checkpointing else 1)
    _assert_same(tiled, plain)
    disable_tiled_mlp(model)
    calls.clear()
    _assert_same(_run(model, ids), plain)
    assert calls == [] and "forward" not in model.model.layers[0].mlp.__dict__


def test_tiled_mlp_survives_deepcopy_and_rejects_bad_shards():
    model, ids = _model_and_ids(False)
    enable_tiled_mlp(model, SEQ, 2)
    twin = copy.deepcopy(model)
    assert twin.model.layers[1].mlp.forward.__self__ is twin.model.layers[1].mlp
    with pytest.raises(ValueError, match=r"train.tiled_mlp_shards=0: expected an integer >= 1"):
        enable_tiled_mlp(model, SEQ, 0)
    assert [default_mlp_shards(n, 48) for n in (7, 192, 193, 385)] == [1, 1, 2, 3]  # slices of 4 x 48 tokens
    assert enable_tiled_mlp(model, 40) == 1  # one slice: the plain MLP, no recomputation
    with pytest.raises(TypeError, match="holds no podkit decoder"):
        enable_tiled_mlp(torch.nn.Linear(2, 2), SEQ)


def _offload_on_cpu(monkeypatch) -> CheckpointOffload:
    """DeepSpeed offloads only device tensors; here CPU tensors count as device tensors, so the whole path
    (mark, pack, copy out, copy back on unpack) runs."""
    offload = CheckpointOffload(use_pin_memory=False, use_streams=False, keep_last_count=1)
    monkeypatch.setattr(offload.manager, "_should_skip", lambda tensor: False)
    return offload


@pytest.mark.parametrize("tiled", [False, True])
def test_checkpoint_offload_equals_plain_checkpointing(tiled, monkeypatch):
    model, ids = _model_and_ids(True)
    plain = _run(model, ids)
    offload = _offload_on_cpu(monkeypatch)
    attach_checkpoint_offload(model, offload)
    if tiled:
        enable_tiled_mlp(model, SEQ)
    with offload:
        got = _run(model, ids)
        stats = offload.stats
        # every layer input is marked and saved once; the newest stays (the backward needs it first)
        assert (stats.marked_tensors, stats.offloaded_tensors, stats.restored_tensors) == (LAYERS, LAYERS - 1,
                                                                                           LAYERS - 1)
        assert stats.offloaded_bytes == (LAYERS - 1) * 2 * SEQ * HEADS * HEAD_DIM * 4
    _assert_same(got, plain)
    attach_checkpoint_offload(model, None)
    assert model.model.checkpoint_offload is None


def test_checkpoint_offload_leaves_no_mark_without_grad(monkeypatch):
    model, ids = _model_and_ids(True)
    offload = _offload_on_cpu(monkeypatch)
    attach_checkpoint_offload(model, offload)
    with offload:
        with torch.no_grad():  # no checkpointing at all: nothing marked
            model(input_ids=ids, use_cache=False)
        assert offload.stats.marked_tensors == 0
        model(input_ids=ids, use_cache=False).logits.sum().backward()
        assert offload.stats.offloaded_tensors == LAYERS - 1
    assert not offload.manager._allowed, "a mark outlived its layer"


@pytest.mark.slow
def test_pipeline_with_tiling_and_offload_matches_plain(tmp_path):
    """train/pod.py, 3 steps: one plain process, and 2 processes of SP = 2 under ZeRO-3 (DeepSpeed gathers
    the MLP weights once per slice) with ``train.tiled_mlp`` (3 slices of the 32 tokens per rank) and
    ``train.activation_offload`` (wired; DeepSpeed moves nothing on CPU). The per-step losses agree."""
    from pipeline_runs import deepspeed_command, pipeline_env, python_command, run
    from test_pipeline_sequence_parallel import _losses, _sharpen_attention
    from tiny_setup import make_texts, make_tiny_model, tiny_recipe, write_recipe

    model_dir = _sharpen_attention(make_tiny_model(tmp_path / "model", heads=4, kv_heads=2))
    train_text, held_out = make_texts(tmp_path / "text")
    common = dict(deepspeed={"config": "recipes/deepspeed/zero3.json"}, eval={"perplexity": False})
    train = {"max_steps": 3, "per_device_batch_size": 1, "save_steps": 100, "learning_rate": 3e-3}
    env = pipeline_env()
    one = tiny_recipe(tmp_path / "one", model_dir, train_text, held_out, train=train, **common)
    run(python_command(write_recipe(tmp_path / "one.yaml", one), "--stages", "explore,train"), env)
    long = tiny_recipe(tmp_path / "long", model_dir, train_text, held_out, **common,
                       train={**train, "sequence_parallel_size": 2, "tiled_mlp": True, "tiled_mlp_shards": 3,
                              "activation_offload": True, "gradient_checkpointing": True})
    done = run(deepspeed_command(write_recipe(tmp_path / "long.yaml", long), "--stages", "explore,train"), env)
    assert "[train] tiled MLP: 3 slices of the 32 tokens per rank" in done.stdout, done.stdout[-3000:]
    assert "[train] checkpointed layer inputs offloaded to CPU" in done.stdout
    reference, tiled = _losses(tmp_path / "one" / "out"), _losses(tmp_path / "long" / "out")
    assert sorted(reference) == sorted(tiled) == [1, 2, 3]
    for step in reference:
        assert abs(reference[step] - tiled[step]) <= 1e-4 * abs(reference[step]), (step, reference, tiled)
