"""The drafter's training prompts: the contamination check (prompt_overlap) and the standard-library code tasks."""
import gzip
import json
import sysconfig
from pathlib import Path

import pytest

from dspark_export.drafter import code_tasks
from dspark_export.drafter.code_tasks import CODE_TASKS_FILE, scan_stdlib, stdlib_code_tasks, write_code_tasks
from dspark_export.drafter.data import EVERY, held_out_index, training_prompt_list
from dspark_export.drafter.prompt_overlap import MIN_RUN, OverlapIndex, words
from dspark_export.fit.compare import EVAL_SPLIT
from dspark_export.paths import prompt_file

HELD = "The quick brown fox jumps over the lazy dog near the river bank at dawn every single day"


def test_thirteen_word_copy_is_caught_whatever_its_case_and_punctuation():
    idx = OverlapIndex([HELD])
    copy = " ".join(words(HELD)[2:15])  # 13 consecutive words
    assert idx.overlaps(f"Tell me: {copy.upper()}!!") and idx.overlaps(copy.replace(" ", ",  "))
    assert not idx.overlaps(" ".join(words(HELD)[2:14]))  # 12 words is not a copy
    assert not idx.overlaps("an unrelated question about sorting a list of numbers in python")


def test_template_phrases_are_not_content_but_the_rest_of_the_text_is():
    suffix = "Please reason step by step and put your final answer in a box."
    content = ["A farmer keeps 12 cows and sells a third of them each spring",
               "Maria reads 30 pages every evening of a novel with 450 pages",
               "A train leaves the station at 9 and travels 80 miles an hour",
               "Tom saves 5 dollars a week to buy a bicycle that costs 120",
               "A baker fills 14 trays with 18 rolls each before sunrise",
               "Six friends share 3 pizzas cut into 8 slices each equally",
               "A tank holds 250 liters and leaks 4 liters every hour overnight"]
    held = [f"{c}. {suffix}" for c in content]
    idx = OverlapIndex(held, boilerplate=5)
    assert idx.template_phrases > 0
    assert not idx.overlaps(f"Sam has 3 apples and eats one. How many are left? {suffix}")  # only the template
    assert idx.overlaps(f"Here is one. {content[4]}?")  # a prompt's content (12 words) is checked whole
    with_few = OverlapIndex(held, boilerplate=100)  # nothing is template: the suffix is content then
    assert with_few.overlaps(f"Sam has 3 apples and eats one. How many are left? {suffix}")


def test_short_held_out_texts_match_whole_from_min_run_words():
    idx = OverlapIndex(["Compute 8 choose 4.", "Hi there"])
    assert idx.overlaps("Please compute 8 choose 4 for me")
    assert not idx.overlaps("compute 8 choose 5") and not idx.overlaps("hi there, how are you")
    assert len(words("Hi there")) < MIN_RUN
    with pytest.raises(ValueError, match="n-gram length"):
        OverlapIndex([], n=MIN_RUN - 1)


def test_every_evaluation_prompt_would_be_refused_as_training_text():
    idx = held_out_index()
    checked = 0
    for name, (a, b) in EVAL_SPLIT.items():
        for line in prompt_file(name).read_text().splitlines()[a:b][:40]:
            turn = json.loads(line)["turns"][0]
            assert idx.overlaps(f"Some preamble. {turn} Thanks!"), (name, turn[:80])
            checked += 1
    assert checked > 150


def test_training_prompts_pass_the_check_and_report_what_was_refused():
    report = {}
    prompts = training_prompt_list(n_sharegpt=EVERY, n_code_tasks=EVERY, report=report)
    keys = [k for _, k, _ in prompts]
    assert len(keys) == len(set(keys))
    assert len(prompts) == sum(r["offered"] - r["refused"] for r in report.values())
    assert report["mbpp"]["offered"] == 180 and report["code-task"]["offered"] > 1000
    assert 0 < sum(r["refused"] for r in report.values()) < 50  # the check refuses a few, not the template's users
    idx = held_out_index()
    assert not any(idx.overlaps(t) for _, _, t in prompts[:2000])
    sources = [s for s, _, _ in prompts[:800]]
    assert sources.count("code-task") >= sources.count("sharegpt") // 2  # code-weighted from the start


def test_code_tasks_are_deterministic_unique_and_name_their_signature():
    tasks = stdlib_code_tasks(EVERY)
    assert len(tasks) > 1000 and len({k for k, _ in tasks}) == len(tasks)
    assert stdlib_code_tasks(50) == tasks[:50] and stdlib_code_tasks(50, seed=1) != tasks[:50]
    quote = dict(tasks)["code-task:shlex.quote"]
    assert "quote(s)" in quote and "shell" in quote.lower()
    assert all(not k.split(":", 1)[1].split(".")[-1].startswith("_") for k, _ in tasks)
    assert not any("(self" in t for _, t in tasks)


def test_code_tasks_come_from_the_packaged_list_not_the_running_python(monkeypatch, tmp_path):
    # every Python version must offer the same prompts (3.12 lacks distutils, 3.13 cgi, ...): the running
    # standard library is never read
    before = stdlib_code_tasks(EVERY)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert stdlib_code_tasks(EVERY) == before
    listed = [json.loads(line)["key"] for line in CODE_TASKS_FILE.read_text().splitlines()]
    assert sorted(listed) == sorted(k for k, _ in before)


def test_scan_and_write_a_standard_library(tmp_path):
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "textops.py").write_text(
        'def shout(text, times=2):\n    """Return the text in upper case, repeated the given number of times."""\n\n'
        'def _hidden(x):\n    """A private helper that is never offered as a task to anyone."""\n\n'
        'class Box:\n    def open(self, lid=True):\n        """Open the box and return whether its lid came off cleanly."""\n'
        '    def close(self):\n        """Short."""\n')
    (lib / "pkg" / "tools.py").write_text('def tidy(rows):\n    """Sort the rows by their first column and drop '
                                             'exact duplicates."""\n')
    (lib / "test_things.py").write_text('def check(x):\n    """A test helper that must be skipped by the scan."""\n')
    tasks = scan_stdlib(lib)
    assert tasks == [  # the top-level modules first, then the packages' (their __init__ files are skipped)
        {"key": "code-task:textops.shout", "signature": "shout(text, times=2)",
         "summary": "Return the text in upper case, repeated the given number of times."},
        {"key": "code-task:textops.Box.open", "signature": "open(lid=True)",
         "summary": "Open the box and return whether its lid came off cleanly."},
        {"key": "code-task:pkg.tools.tidy", "signature": "tidy(rows)",
         "summary": "Sort the rows by their first column and drop exact duplicates."}]
    out = tmp_path / "tasks.jsonl"
    assert write_code_tasks(out, lib) == 3
    assert [json.loads(line) for line in out.read_text().splitlines()] == tasks


def test_a_missing_packaged_list_is_a_clear_error(monkeypatch, tmp_path):
    from dspark_runtime.errors import DSparkError
    monkeypatch.setattr(code_tasks, "CODE_TASKS_FILE", tmp_path / "none.jsonl")
    with pytest.raises(DSparkError, match="code-task list is missing or malformed"):
        stdlib_code_tasks(5)


def test_the_committed_answers_resolve_in_the_prompt_pool():
    # an answers file may only hold keys of the checked pool (pipeline.import_answers): the committed one must
    # resolve on every Python version, which the packaged code-task list guarantees
    path = Path(__file__).parents[3] / "engines/drafters/data/qwen2.5-coder-1.5b-int4-answers.jsonl.gz"
    keys = [json.loads(line)["key"] for line in gzip.open(path, "rt")]
    pool = {k for _, k, _ in training_prompt_list(n_sharegpt=EVERY, n_code_tasks=EVERY)}
    assert len(keys) > 1000 and not [k for k in keys if k not in pool]
