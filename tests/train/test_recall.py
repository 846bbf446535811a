"""podkit:recall (train/corpus/recall.py): synthetic recall episodes over prose."""

import re

import pytest

from train.corpus import recall

PROSE = {name: [("\n\n".join(f"{name} paragraph {d}.{i} " + "word " * 40 for i in range(60)))
                for d in range(3)] for name in ("a", "b")}
ANSWER = re.compile(r"Q: What is (.+?)'s (.+?)\?\nA: \1's \2 is (.+?)\.\n")


def _documents(**kwargs):
    return list(recall.recall_documents(PROSE, **kwargs))


def test_documents_are_deterministic_and_depend_on_the_seed():
    assert _documents(documents=5) == _documents(documents=5)
    assert _documents(documents=5, seed=1) != _documents(documents=5)


def test_every_answer_is_stated_earlier_in_its_episode_beyond_a_short_window():
    docs = _documents(documents=6)
    assert len(docs) == 6
    answered = 0
    for doc in docs:
        for episode in doc.split("\n\nQuiz.\n")[:-1]:
            assert len(episode) > 0
        for match in ANSWER.finditer(doc):
            who, what, value = match.groups()
            before = doc[:match.start()]
            facts = [m for m in re.finditer(re.escape(value), before)
                     if who in before[max(0, m.start() - 80):m.end()] and what in before[max(0, m.start() - 80):m.end()]]
            assert facts, f"no fact for {who}'s {what} = {value}"
            # the fact sits in the episode's first FACT_SPAN: hundreds of characters before the quiz
            quiz = before.rfind("Quiz.")
            assert quiz - facts[-1].start() > 0.2 * recall.EPISODE_CHARS[0]
            answered += 1
    assert answered >= 6 * recall.EPISODES_PER_DOCUMENT * 1


def test_wording_is_disjoint_from_the_evaluated_tasks():
    from eval.tasks import needle, passkey

    text = "\n".join(_documents(documents=20)).lower()
    # the prose filler here is synthetic; the templates are what could leak an evaluation format
    templates = " ".join(recall.FACT_TEMPLATES + (recall.QUIZ_HEADER, recall.QUESTION)).lower()
    for phrase in recall.EVALUATION_PHRASES + ("the pass key is", "what is the secret"):
        assert phrase.lower() not in text and phrase.lower() not in templates
    assert passkey.NEEDLE.split("{")[0].strip().lower() not in text
    assert "secret" in open(needle.__file__).read()  # the phrase list above tracks needle.py's wording


def test_prose_runs_out_before_the_document_count():
    short = {"a": ["x\n" * 2000]}
    docs = list(recall.recall_documents(short, documents=10_000))
    assert 0 < len(docs) < 10_000


def test_recall_is_an_embedded_source_read_from_token_shards():
    from train.corpus.documents import podkit_names
    from train.data import _uses_shards

    assert "recall" in podkit_names() and _uses_shards("podkit:recall")


LONG_PROSE = {name: [("\n\n".join(f"{name} paragraph {d}.{i} " + "word " * 40 for i in range(400)))
                     for d in range(2)] for name in ("a", "b", "c")}


def test_recall_output_is_pinned_unless_its_version_changes():
    """podkit:recall's documents are what its token shards were built from: a change must bump RECALL_VERSION."""
    import hashlib

    docs = _documents(documents=40)  # the synthetic prose runs out at 10 documents
    assert len(docs) == 10 and recall.RECALL_VERSION == 1
    assert hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:16] == "8d41ff48a1df12c6"


def test_long_shape_one_episode_per_document_every_fact_far_before_its_question():
    shape = recall.SHAPES["recall-long"]
    docs = list(recall.recall_documents(LONG_PROSE, documents=9, shape=shape))
    assert len(docs) == 9 and docs == list(recall.recall_documents(LONG_PROSE, documents=9, shape=shape))
    # documents start at successive sources, so every genre is filler even with one episode per document
    assert [d.split(" paragraph")[0] for d in docs[:3]] == ["a", "b", "c"]
    answered = 0
    for doc in docs:
        assert doc.count(recall.QUIZ_HEADER) == 1
        quiz = doc.index(recall.QUIZ_HEADER)
        assert shape.episode_chars[0] // 2 <= quiz <= shape.episode_chars[1] + 200
        for match in ANSWER.finditer(doc):
            who, what, value = match.groups()
            stated = [m.start() for m in re.finditer(re.escape(f"{what}"), doc[:quiz]) if who in doc[m.start() - 60:m.end() + 60]]
            assert stated, f"no fact for {who}'s {what}"
            # facts sit in the first half: at least half an episode (~2K tokens) before the quiz
            assert quiz - max(stated) >= 0.45 * shape.episode_chars[0]
            answered += 1
    assert answered >= 9
    assert shape.row_aligned and not recall.SHAPES["recall"].row_aligned and shape.min_context == 8192


def test_recall_sources_are_registered_and_only_the_long_one_is_row_aligned():
    from train.corpus import documents
    from train.data import _uses_shards

    assert documents.RECALL_NAMES == tuple(recall.SHAPES)
    for name in documents.RECALL_NAMES:
        assert name in documents.podkit_names() and _uses_shards(f"podkit:{name}")
    assert documents.row_aligned("podkit:recall-long")
    assert not documents.row_aligned("podkit:recall") and not documents.row_aligned("podkit:austen")
    assert not documents.row_aligned("./recall-long")


def test_long_recall_below_its_context_is_one_clear_error(tmp_path):
    from train.recipe import RecipeError, recipe_from_dict

    base = {"model": {"name_or_path": "podkit:smollm2-135m"}, "pod": {"recent_window": 240},
            "data": {"train": "podkit:austen=1,podkit:recall-long=1", "context_length": 2048},
            "train": {"output_dir": str(tmp_path / "out")}}
    with pytest.raises(RecipeError) as error:
        recipe_from_dict(base)
    assert ("data.train: podkit:recall-long needs data.context_length >= 8192, got 2048" in str(error.value))
    assert not (tmp_path / "out").exists()
    ok = recipe_from_dict(base, ["data.context_length=8192", "pod.recent_window=1008"])
    assert ok.data.context_length == 8192
    recipe_from_dict(base, ["data.train=podkit:austen=1,podkit:recall=1"])  # the short shape fits 2K rows
