"""Offline lm-evaluation-harness tasks built from quantkit's own held-out text.

Two tasks, both from the held-out split of a built-in calibration set (never from calibration
text), generated deterministically at run time, so their provenance is exactly that of the set
(public domain / PSF-2.0, see calibration_sets/manifest.json):

  quantkit_heldout_<set>  loglikelihood_rolling over held-out documents of ~2000 characters (like lm-eval's
                          wikitext): word_perplexity, byte_perplexity, bits_per_byte.
  quantkit_cloze_<set>    multiple choice: 40 words of held-out text, then which of four 12-word
                          spans really continues it (three distractor spans come from other
                          passages of the same split): acc, acc_norm. Chance is 25 %.
Task YAMLs point at absolute JSONL paths, so they are written next to the data in the cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from quantkit.calibration import builtin_sets, load_heldout_text
from quantkit.errors import QuantkitError
from quantkit.machine import cache_dir

__all__ = ["offline_task_dir", "task_manager", "only_offline", "OFFLINE_TASKS", "resolve_tasks"]

CLOZE_ITEMS = 300
CONTEXT_WORDS = 40
CHOICE_WORDS = 12
_VERSION = 3
DOC_CHARS = 2000


def _passages(text: str) -> list[str]:
    """Consecutive, non-overlapping windows of context + answer words; a window runs on over
    paragraph breaks (verse and code have short paragraphs), so the held-out text gives ~500."""
    size = CONTEXT_WORDS + CHOICE_WORDS
    words = text.split()
    return [" ".join(words[i:i + size]) for i in range(0, len(words) - size + 1, size)]


def _pack(text: str, chars: int = DOC_CHARS) -> list[str]:
    """Consecutive paragraphs packed into documents of about `chars` characters."""
    docs, cur = [], ""
    for p in (p.strip() for p in text.split("\n\n")):
        if p:
            cur = f"{cur}\n\n{p}" if cur else p
            if len(cur) >= chars:
                docs.append(cur)
                cur = ""
    return docs + ([cur] if cur else [])


def _cloze_items(passages: list[str], seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    spans = []
    for p in passages:
        w = p.split()
        spans.append((" ".join(w[:CONTEXT_WORDS]), " ".join(w[CONTEXT_WORDS:CONTEXT_WORDS + CHOICE_WORDS])))
    order = list(range(len(spans)))
    rng.shuffle(order)
    items = []
    for i in order[:CLOZE_ITEMS]:
        context, gold = spans[i]
        others = [j for j in range(len(spans)) if j != i and spans[j][1] != gold]
        distractors = [spans[j][1] for j in rng.sample(others, 3)]
        label = rng.randrange(4)
        choices = distractors[:label] + [gold] + distractors[label:]
        items.append({"id": len(items), "context": context, "choices": choices, "label": label})
    return items


def offline_task_dir(sets: tuple[str, ...] | None = None) -> Path:
    """Build (once) the JSONL data and task YAMLs for the built-in sets; return their folder."""
    sets = sets or tuple(builtin_sets())
    texts = {s: load_heldout_text(s) for s in sets}
    key = hashlib.sha1(json.dumps([_VERSION, CLOZE_ITEMS] + [t[1].get("sha256") for t in texts.values()]).encode()).hexdigest()[:10]
    root = cache_dir() / "lmeval-tasks" / key
    if (root / "done").is_file():
        return root
    # built in a private folder and renamed: a second process (parallel tests, two evals)
    # never reads a file another one is still writing
    build = root.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    for name, (text, info) in texts.items():
        docs = [{"text": d} for d in _pack(text)]
        (build / f"heldout_{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        items = _cloze_items(_passages(text))
        (build / f"cloze_{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in items))
        provenance = f"held-out split of quantkit built-in set '{name}' ({', '.join(info.get('licences', []))})"
        (build / f"quantkit_heldout_{name}.yaml").write_text(_yaml_rolling(name, root, provenance))
        (build / f"quantkit_cloze_{name}.yaml").write_text(_yaml_cloze(name, root, provenance))
    (build / "done").write_text("ok")
    try:
        build.rename(root)
    except OSError:  # another process finished first (or a stale partial folder from an old version)
        if not (root / "done").is_file():
            shutil.rmtree(root, ignore_errors=True)
            build.rename(root)
            return root
        shutil.rmtree(build, ignore_errors=True)
    return root


def _yaml_rolling(name: str, root: Path, provenance: str) -> str:
    return f"""# {provenance}
task: quantkit_heldout_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / f"heldout_{name}.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: {_VERSION}
"""


def _yaml_cloze(name: str, root: Path, provenance: str) -> str:
    return f"""# {provenance}; distractors from other passages of the same split
task: quantkit_cloze_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / f"cloze_{name}.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: {_VERSION}
"""


OFFLINE_TASKS = tuple(f"quantkit_{kind}_{s}" for kind in ("cloze", "heldout")
                      for s in ("mixed", "prose", "code", "techdoc"))


def only_offline(tasks: list[str]) -> bool:
    """Whether every task is one of quantkit's own (no need to index lm-eval's ~14,000 task
    YAML files, which takes 10-25 s on a 2-core machine)."""
    return bool(tasks) and set(tasks) <= set(OFFLINE_TASKS)


def task_manager(tasks: list[str]):
    """lm-eval's TaskManager for `tasks`: over quantkit's offline task folder alone when that
    is all they need, else with lm-eval's own tasks too; built once per process."""
    return _task_manager(str(offline_task_dir()), not only_offline(tasks))


@functools.lru_cache(maxsize=2)
def _task_manager(include_path: str, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def resolve_tasks(names: list[str], manager) -> list[str]:
    """Known task names; a clear error for unknown ones and for Hub tasks while offline."""
    import os

    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise QuantkitError(
            f"Unknown lm-eval task(s): {', '.join(unknown)}.",
            f"Offline tasks shipped with quantkit: {', '.join(OFFLINE_TASKS)}; "
            "any lm-eval task name works when its dataset can be downloaded.")
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or \
        os.environ.get("HF_DATASETS_OFFLINE", "0").lower() in ("1", "true", "yes")
    hub = [n for n in names if not n.startswith("quantkit_")]
    if hub and offline:
        raise QuantkitError(
            f"Task(s) {', '.join(hub)} need their dataset from the Hugging Face Hub, and "
            "HF_HUB_OFFLINE is set.",
            f"Run them on a machine with Hub access, or use the offline tasks: {', '.join(OFFLINE_TASKS)}.")
    return names
