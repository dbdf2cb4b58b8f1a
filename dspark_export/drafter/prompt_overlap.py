"""The contamination check of drafter training prompts: word n-gram overlap with held-out prompts.

A training prompt is refused when it shares any run of ``n`` consecutive words with a held-out prompt (the
evaluation and calibration splits, every turn). Words are lower-cased runs of letters and digits, so punctuation,
case and spacing do not hide a copy. ``n`` = 13 is the contamination test of GPT-3 (Brown et al. 2020, appendix C).

Templates are not content: a phrase of ``TEMPLATE_WORDS`` words found in more than ``boilerplate`` held-out texts
(GSM8K's "Please reason step by step, and put your final answer within \\boxed{}", MBPP's "Write a python function
to") marks its words as template, and only the runs of non-template words are checked — by their n-grams, or whole
when a run is shorter than ``n`` but at least ``MIN_RUN`` words (short problems such as "Compute 8 choose 4" are
still caught). Held-out texts of fewer than ``MIN_RUN`` words are not checked.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

_WORD = re.compile(r"[a-z0-9]+")
DEFAULT_N = 13
DEFAULT_BOILERPLATE = 5
TEMPLATE_WORDS = 6
MIN_RUN = 4


def words(text: str) -> tuple:
    """The lower-cased alphanumeric words of ``text``, in order."""
    return tuple(_WORD.findall(text.lower()))


def _grams(w: tuple, k: int) -> set:
    return {w[i:i + k] for i in range(len(w) - k + 1)}


class OverlapIndex:
    """What a set of held-out texts forbids (see the module doc); :meth:`overlaps` tells whether a text copies it.

    Args:
        held_out: the texts no training prompt may copy from.
        n: words per n-gram (>= ``MIN_RUN``).
        boilerplate: a ``TEMPLATE_WORDS``-word phrase in more held-out texts than this is template.
    Raises:
        ValueError: ``n`` < ``MIN_RUN``.
    """

    def __init__(self, held_out: Iterable[str], n: int = DEFAULT_N, boilerplate: int = DEFAULT_BOILERPLATE):
        if n < MIN_RUN:
            raise ValueError(f"n-gram length must be >= {MIN_RUN}, got {n}")
        self.n = n
        texts = [w for w in (words(t) for t in held_out) if len(w) >= MIN_RUN]
        seen_in = Counter(g for w in texts for g in _grams(w, TEMPLATE_WORDS))
        template = {g for g, c in seen_in.items() if c > boilerplate}
        self.template_phrases = len(template)
        self._grams: set = set()
        self._runs: dict = {}  # length -> runs of non-template words shorter than n
        for w in texts:
            in_template = [False] * len(w)
            for i in range(len(w) - TEMPLATE_WORDS + 1):
                if w[i:i + TEMPLATE_WORDS] in template:
                    in_template[i:i + TEMPLATE_WORDS] = [True] * TEMPLATE_WORDS
            run: list = []
            for word, skip in zip(w + ("",), in_template + [True]):
                if not skip:
                    run.append(word)
                    continue
                if len(run) >= n:
                    self._grams |= _grams(tuple(run), n)
                elif len(run) >= MIN_RUN:
                    self._runs.setdefault(len(run), set()).add(tuple(run))
                run = []

    def overlaps(self, text: str) -> bool:
        """Whether ``text`` holds one of the held-out n-grams or one of the shorter held-out runs."""
        w = words(text)
        if any(g in self._grams for g in _grams(w, self.n)):
            return True
        return any(g in runs for k, runs in self._runs.items() for g in _grams(w, k))
