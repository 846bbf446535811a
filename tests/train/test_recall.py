"""podkit:recall (train/corpus/recall.py): synthetic recall episodes over prose."""

import re

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
