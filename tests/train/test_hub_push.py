"""Hub push against a local Hub-compatible server: round trip, bad token, failing/unreachable server,
token and local paths never uploaded."""

import json
import socket

import pytest
import torch
from fake_hub import FakeHub  # tests/train is on sys.path (pytest rootdir-less import)

from train.hub import HubPushError, push_export

TOKEN = "hf_test_token_0123456789abcdef"


@pytest.fixture
def online(monkeypatch):
    """tests/conftest.py sets HF_HUB_OFFLINE=1; loopback pushes need it off (huggingface_hub refuses network calls otherwise)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture
def tiny_export(tmp_path):
    from tests.tiny_models import tiny_model

    model = tiny_model(layers=2, seed=None, podkit=False, vocab=64, heads=4, kv_heads=2, hidden=32, positions=128)
    folder = tmp_path / "export"
    model.save_pretrained(folder)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return model, folder


def test_push_download_reload_identical_logits(online, tiny_export, tmp_path):
    from huggingface_hub import snapshot_download
    from transformers import LlamaForCausalLM

    model, folder = tiny_export
    with FakeHub(token=TOKEN) as hub:
        url = push_export(folder, "tester/tiny-pod", endpoint=hub.endpoint)
        assert "tester/tiny-pod" in url
        assert set(hub.repos["tester/tiny-pod"]) == {p.name for p in folder.iterdir()}
        for data in hub.repos["tester/tiny-pod"].values():
            assert TOKEN.encode() not in data
        local = snapshot_download("tester/tiny-pod", endpoint=hub.endpoint, cache_dir=tmp_path / "cache", token=TOKEN)
        reloaded = LlamaForCausalLM.from_pretrained(local).eval()
        # a second identical push is a no-op commit on the server side
        push_export(folder, "tester/tiny-pod", endpoint=hub.endpoint)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    # the token never travelled in a request path and is only in the Authorization header
    assert all(TOKEN not in path for _, path, _ in hub.requests)


def test_bad_token_clear_error_export_intact(online, tiny_export, monkeypatch, capsys):
    _, folder = tiny_export
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with FakeHub(token="hf_the_right_one") as hub:
        with pytest.raises(HubPushError, match="rejected the token") as info:
            push_export(folder, "tester/x", endpoint=hub.endpoint)
    assert TOKEN not in str(info.value)
    assert TOKEN not in capsys.readouterr().out + capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_failing_server_and_unreachable_server(online, tiny_export):
    _, folder = tiny_export
    with FakeHub(token=TOKEN) as hub:
        hub.fail_with = 500
        with pytest.raises(HubPushError, match="answered 500") as info:
            push_export(folder, "tester/x", endpoint=hub.endpoint)
        assert "export" in str(info.value) and "intact" in str(info.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    with pytest.raises(HubPushError, match="cannot reach the Hub"):
        push_export(folder, "tester/x", endpoint=f"http://127.0.0.1:{port}")
    assert (folder / "config.json").is_file()


def test_no_token(online, tiny_export, monkeypatch):
    _, folder = tiny_export
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(folder.parent / "empty_hf_home"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(folder.parent / "no_token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(folder.parent / "no_tokens"))
    with pytest.raises(HubPushError, match="no Hugging Face token"):
        push_export(folder, "tester/x", endpoint="http://127.0.0.1:9")


def test_refuses_token_or_local_paths_in_export(online, tiny_export):
    _, folder = tiny_export
    card = folder / "README.md"
    card.write_text(f"trained from {folder.resolve()}/base\n")
    with pytest.raises(HubPushError, match="local path"):
        push_export(folder, "tester/x", endpoint="http://127.0.0.1:9")
    card.write_text(json.dumps({"token": TOKEN}))
    with pytest.raises(HubPushError, match="contains the Hub token"):
        push_export(folder, "tester/x", endpoint="http://127.0.0.1:9")
