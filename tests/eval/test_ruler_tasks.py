"""RULER offline (train/long_context_eval/ruler.py): every task generates at a small length with SmolLM2's tokenizer,
fits its budget (plain and chat-rendered), is deterministic per seed, and scores known answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("long_context_eval", reason="nvidia-long-context-eval is installed by the eval extra")
pytest.importorskip("lm_eval")

from train.long_context_eval import ruler  # noqa: E402

ISSUE_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]
LENGTH = 2048  # the shortest length every task supports (HotpotQA's paragraphs need ~1.5K tokens)


@pytest.fixture(scope="module")
def tokenizer():
    from eval.models import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def samples(tokenizer):
    return {task: ruler.generate(task, tokenizer, LENGTH, 2, seed=0) for task in ISSUE_TASKS}


def test_every_issue_task_is_defined_with_a_yaml():
    assert list(ruler.TASKS) == ISSUE_TASKS
    folder = Path(__file__).resolve().parents[2] / "eval" / "tasks"
    for task in ISSUE_TASKS:
        text = (folder / f"podkit_ruler_{task}.yaml").read_text()
        assert f"task: podkit_ruler_{task}\n" in text and f"lm_eval_tasks.ruler_{task}\n" in text
        family = ruler.TASKS[task][0]
        assert f"max_gen_toks: {ruler.TOKENS_TO_GENERATE[family]}\n" in text


@pytest.mark.parametrize("task", ISSUE_TASKS)
def test_samples_have_the_structure_and_fit_the_budget(task, samples, tokenizer):
    family = ruler.TASKS[task][0]
    assert len(samples[task]) == 2
    for sample in samples[task]:
        assert sample.task == task and sample.max_length == LENGTH and sample.outputs
        assert 0 < sample.question_start < len(sample.input)
        assert ruler.QUESTION_START[family].match(sample.question)
        assert not ruler.QUESTION_START[family].search(sample.context[sample.context.rfind("\n"):])
        if family in ("niah", "vt", "cwe", "fwe"):  # the answers are words of the prompt (QA's may be paraphrased)
            assert all(answer in sample.input for answer in sample.outputs), sample.outputs
        if family == "niah":
            assert all(answer in sample.context for answer in sample.outputs)
            # the query keys are in the question and the answer prefix
            assert sample.gen_prefix.startswith("The special magic")
        for chat in (False, True):
            assert ruler.prompt_tokens(sample, tokenizer, chat) + sample.tokens_to_generate <= LENGTH
        # filled to most of the budget (RULER grows the haystack in steps, so not exactly to it)
        assert sample.num_tokens + sample.tokens_to_generate > 0.55 * LENGTH, sample.num_tokens


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe", "qa_1"])
def test_deterministic_per_seed(task, samples, tokenizer):
    again = ruler.generate(task, tokenizer, LENGTH, 2, seed=0)
    assert [s.to_dict() for s in again] == [s.to_dict() for s in samples[task]]
    other = ruler.generate(task, tokenizer, LENGTH, 2, seed=1)
    assert [s.input for s in other] != [s.input for s in samples[task]]


def test_tasks_sharing_a_seed_draw_different_needles(samples):
    assert samples["niah_single_1"][0].outputs != samples["niah_single_2"][0].outputs


def test_render_plain_and_chat(samples, tokenizer):
    sample = samples["niah_single_1"][0]
    context, question = ruler.render(sample, tokenizer, chat=False)
    assert context + question == sample.input + " " + sample.gen_prefix
    context, question = ruler.render(sample, tokenizer, chat=True)
    assert context.startswith("<|im_start|>") and context.endswith(sample.context)
    assert question.startswith(sample.question) and question.endswith("<|im_start|>assistant\n" + sample.gen_prefix)


def test_bad_arguments_are_named(tokenizer):
    with pytest.raises(ValueError, match="task='niah'"):
        ruler.generate("niah", tokenizer, 2048, 1)
    with pytest.raises(ValueError, match="length=512 is invalid for vt"):
        ruler.generate("vt", tokenizer, 512, 1)
    with pytest.raises(ValueError, match="length=1024 is invalid for qa_2"):
        ruler.generate("qa_2", tokenizer, 1024, 1)
    with pytest.raises(ValueError, match="num_samples=0"):
        ruler.generate("vt", tokenizer, 2048, 0)


def test_scoring_on_known_answers():
    assert ruler.score("niah_single_1", " 1234567.", ["1234567"]) == 1.0
    assert ruler.score("niah_single_1", " 123456.", ["1234567"]) == 0.0
    assert ruler.score("niah_multivalue", "1111111, 2222222 and 3", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert ruler.score("cwe", "1. Apple 2. PEAR", ["apple", "pear"]) == 1.0       # case-insensitive
    assert ruler.score("qa_1", "It was France.", ["France", "the French kingdom"]) == 1.0  # QA: any reference
    assert ruler.score("qa_2", "no idea", ["yes"]) == 0.0
    assert ruler.score("vt", "\x00 VAR AB", ["AB", "CD"]) == 0.5


def test_fallback_scoring_matches_lm_eval():
    """The GPU image has no lm-eval: the written-out functions must score exactly like lm-eval's."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    cases = [(" 1234567\x01 and 7654321 ", ["1234567", "7654321"]), ("Apple pear", ["apple", "plum", "PEAR"]),
             ("", ["x"]), ("\tVAR QWERT = 5\n", ["qwert"])]
    for prediction, references in cases:
        assert ruler._postprocess_pred([prediction]) == postprocess_pred([prediction])
        cleaned = postprocess_pred([prediction])
        assert ruler._match_all(cleaned, [references]) == string_match_all(cleaned, [references])


def test_lm_eval_dataset_hook(tokenizer):
    from eval.tasks import lm_eval_tasks

    data = lm_eval_tasks.ruler_vt(pretrained="default", lengths=[1024, 2048], num_samples=1, seed=3)["test"]
    assert data["max_length"] == [1024, 2048] and data["task"] == ["vt", "vt"]
    doc = data[0]
    assert lm_eval_tasks.process_ruler(doc, [" " + " ".join(doc["outputs"])]) == {"score": 1.0}
    assert lm_eval_tasks.process_ruler(doc, ["nothing"]) == {"score": 0.0}
    assert re.search(r"ruler_qa_2", " ".join(dir(lm_eval_tasks)))
