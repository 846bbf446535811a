"""Model folder checks (sparse_models/model_files.py) and the one-line errors of ``sparse_models.generate`` (issue 33
section 4): a file as ``--model``, a folder without config.json, a truncated model.safetensors (named), an
incomplete export (what is missing), a binary prompt file (named) and a folder as ``--prompt-file``."""

from __future__ import annotations

import json

import pytest

from sparse_models.model_files import (
    EXPORT_MANIFEST,
    ModelPathError,
    check_model_folder,
    model_folder_problems,
    write_export_manifest,
)


@pytest.fixture
def checkpoint(tmp_path):
    from sm_tiny import tiny_model

    folder = tmp_path / "ckpt"
    tiny_model(layers=2).save_pretrained(folder)
    return folder


def _generate(capsys, *args) -> tuple[int, list[str]]:
    from sparse_models.generate import main

    status = main(list(args))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return status, err


def test_saved_model_is_loadable(checkpoint):
    assert model_folder_problems(checkpoint) == []
    assert check_model_folder(checkpoint) == checkpoint


def test_truncated_weights_named_by_the_loader(checkpoint):
    from sparse_models import PodkitLlamaForCausalLM

    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    problems = model_folder_problems(checkpoint)
    assert len(problems) == 1 and str(weights) in problems[0] and "is truncated" in problems[0], problems
    with pytest.raises(ModelPathError, match="model.safetensors is truncated"):
        PodkitLlamaForCausalLM.from_pretrained(checkpoint)


def test_config_problems(tmp_path, checkpoint):
    (checkpoint / "config.json").write_bytes(b"\x89PNG\x00\xff")
    assert "is not a JSON text file (not UTF-8" in model_folder_problems(checkpoint)[0]
    (checkpoint / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in model_folder_problems(checkpoint)[0]
    (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert "names no model_type" in model_folder_problems(checkpoint)[0]
    (checkpoint / "config.json").unlink()
    assert model_folder_problems(checkpoint) == [f"{checkpoint} has no config.json: not a model folder (a folder with "
                                                 f"config.json and the weights, as save_pretrained writes them)"]


def test_sharded_index_with_a_missing_shard(checkpoint):
    weights = checkpoint / "model.safetensors"
    weights.rename(checkpoint / "model-00001-of-00002.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    problems = model_folder_problems(checkpoint)
    assert len(problems) == 1 and "lists shards that are missing: model-00002-of-00002.safetensors" in problems[0]


def test_export_manifest_incomplete_and_missing_parts(checkpoint):
    write_export_manifest(checkpoint, complete=False)  # an export interrupted after its weights
    (problem,) = model_folder_problems(checkpoint)
    assert problem.startswith(f"export {checkpoint} is incomplete: it was interrupted while being written")
    for part in ("no tokenizer files", "no modeling_podkit.py", "no model card (README.md)", "no auto_map"):
        assert part in problem, problem
    assert problem.endswith("re-run the export stage (train/pod.py RECIPE --stages export)")
    for name in ("modeling_podkit.py", "README.md", "tokenizer.json", "tokenizer_config.json", "pod_blocks.json"):
        (checkpoint / name).write_text("{}")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "auto_map": {}}))
    write_export_manifest(checkpoint, complete=True)
    assert json.loads((checkpoint / EXPORT_MANIFEST).read_text())["complete"] is True
    assert model_folder_problems(checkpoint) == []
    (checkpoint / "pod_blocks.json").unlink()  # a listed file that went missing since
    (checkpoint / "tokenizer.json").unlink()
    (problem,) = model_folder_problems(checkpoint)
    assert "no tokenizer files (tokenizer_config.json and one of tokenizer.json" in problem and \
        "no pod_blocks.json" in problem and "interrupted" not in problem, problem


def test_generate_model_errors_are_one_line(capsys, tmp_path, checkpoint):
    capsys.readouterr()  # the fixture's save_pretrained progress bar
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    status, err = _generate(capsys, "--model", str(readme), "--prompt-file", str(prompt))
    assert status == 2 and len(err) == 1 and "is a file, not a model folder" in err[0], err
    empty = tmp_path / "empty"
    empty.mkdir()
    status, err = _generate(capsys, "--model", str(empty), "--prompt-file", str(prompt))
    assert status == 2 and len(err) == 1 and "has no config.json" in err[0] and "model_type" not in err[0], err
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    status, err = _generate(capsys, "--model", str(checkpoint), "--prompt-file", str(prompt))
    assert status == 2 and len(err) == 1 and str(weights) in err[0] and "truncated" in err[0], err


def test_generate_prompt_file_errors_are_one_line(capsys, tmp_path):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    status, err = _generate(capsys, "--model", "default", "--prompt-file", str(binary))
    assert status == 2 and len(err) == 1 and str(binary) in err[0] and "is not a text file" in err[0], err
    status, err = _generate(capsys, "--model", "default", "--prompt-file", str(tmp_path))
    assert status == 2 and len(err) == 1 and "is a folder, not a file" in err[0] and "does not exist" not in err[0]
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a"}\n{broken\n')
    status, err = _generate(capsys, "--model", "default", "--prompt-file", str(lines))
    assert status == 2 and len(err) == 1 and str(lines) in err[0] and "line 2 is not JSON" in err[0], err
