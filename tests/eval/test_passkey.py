"""The passkey / needle generators: exact lengths, needle placement by depth, scoring, reproducibility."""

import random

import pytest

from eval.tasks.haystack import FILLER, encode
from eval.tasks.needle import make_needle_sample, needle_correct, needle_grid
from eval.tasks.passkey import INTRO, NEEDLE, QUESTION, depth_grid, make_passkey_sample, passkey_correct, passkey_grid


def test_depth_grid_spans_zero_to_one():
    assert depth_grid(10)[0] == 0.0 and depth_grid(10)[-1] == 1.0 and len(depth_grid(10)) == 10
    assert depth_grid(1) == [0.5]
    with pytest.raises(ValueError, match="num_depths"):
        depth_grid(0)


@pytest.mark.parametrize("length", [130, 257, 1000, 2049])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_passkey_length_is_exact_and_needle_is_inside(tiny_tokenizer, length, depth):
    sample = make_passkey_sample(tiny_tokenizer, length, depth, seed=random.randrange(1000))
    assert sample.num_tokens == length == len(encode(tiny_tokenizer, sample.prompt))
    assert sample.context.startswith(INTRO) and sample.prompt.endswith(QUESTION)
    assert NEEDLE.format(key=sample.passkey) in sample.context
    assert len(sample.passkey) == 5 and sample.answer == " " + sample.passkey
    assert sample.context.count(sample.passkey) == 2  # stated twice by the needle, nowhere else


def test_needle_position_follows_depth(tiny_tokenizer):
    positions = []
    for depth in depth_grid(6):
        sample = make_passkey_sample(tiny_tokenizer, 1500, depth, seed=3)
        needle_at = sample.context.index(NEEDLE.format(key=sample.passkey))
        positions.append((needle_at - len(INTRO)) / (len(sample.context) - len(INTRO)))
    assert positions == sorted(positions)
    assert positions[0] < 0.02 and positions[-1] > 0.9
    for depth, position in zip(depth_grid(6), positions):
        assert abs(position - depth) < 0.1, (depth, position)


def test_filler_haystack_is_whole_sentences(tiny_tokenizer):
    sample = make_passkey_sample(tiny_tokenizer, 800, 0.5, seed=1)
    before, after = sample.context[len(INTRO):].split(NEEDLE.format(key=sample.passkey))
    assert before.rstrip().endswith(".")  # the needle sits between sentences
    assert FILLER.strip()[:40] in before


def test_same_seed_same_sample_other_seed_other_key(tiny_tokenizer):
    a = make_passkey_sample(tiny_tokenizer, 300, 0.5, seed=7)
    assert a == make_passkey_sample(tiny_tokenizer, 300, 0.5, seed=7)
    keys = {make_passkey_sample(tiny_tokenizer, 300, 0.5, seed=s).passkey for s in range(8)}
    assert len(keys) > 4


def test_grid_covers_lengths_times_depths(tiny_tokenizer):
    samples = passkey_grid(tiny_tokenizer, [128, 256], num_depths=4, samples_per_cell=2)
    assert len(samples) == 16
    assert {(s.target_tokens, s.depth) for s in samples} == {(n, d) for n in (128, 256) for d in depth_grid(4)}


def test_book_haystack(tiny_tokenizer, fake_text_cache):
    sample = make_passkey_sample(tiny_tokenizer, 600, 0.25, haystack="moby_dick", seed=2)
    assert sample.num_tokens == 600 and "truth universally" in sample.context
    assert "grass is green" not in sample.context


def test_bad_arguments_name_the_field(tiny_tokenizer):
    with pytest.raises(ValueError, match="target_tokens=8"):
        make_passkey_sample(tiny_tokenizer, 8, 0.5)
    with pytest.raises(ValueError, match="depth=1.5"):
        make_passkey_sample(tiny_tokenizer, 300, 1.5)
    with pytest.raises(ValueError, match="haystack='nope'"):
        make_passkey_sample(tiny_tokenizer, 300, 0.5, haystack="nope")
    with pytest.raises(ValueError, match="too short"):
        make_passkey_sample(tiny_tokenizer, 60, 0.5)


def test_passkey_scoring():
    assert passkey_correct(" 71432. Remember", "71432")
    assert passkey_correct("71432", "71432")
    assert not passkey_correct(" 7143", "71432")
    assert not passkey_correct(" 12345 71432", "71432")
    assert not passkey_correct(" no idea", "71432")


def test_needle_sample_and_scoring(tiny_tokenizer, fake_text_cache):
    sample = make_needle_sample(tiny_tokenizer, 700, 0.5, seed=4)
    assert sample.num_tokens == 700
    assert f" is {sample.passkey}. " in sample.context and sample.prompt.endswith(" is")
    assert needle_correct(" " + sample.passkey.upper() + ".", sample.passkey)
    assert not needle_correct(" something", sample.passkey)
    assert len(needle_grid(tiny_tokenizer, [300], num_depths=3)) == 3
