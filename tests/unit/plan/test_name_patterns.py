"""Many ``fnmatch`` patterns at once: the same answers as ``fnmatch.fnmatchcase``, pattern by pattern,
with literal names and prefixes looked up rather than compiled (100,000 patterns took a minute)."""

from __future__ import annotations

import fnmatch
import itertools
import random

import pytest

from reshard_job.plan.name_patterns import NamePatterns

# every form: literal, prefix, '*', wildcards inside, classes, an unclosed '[', a backslash, a newline
PATTERNS = ["layers.0.w", "layers.*", "layers.1*", "*", "*.bias", "l?yers.*", "[ab]*.w", "a[", "a\\*", "x\n*",
            "layers.**", "adam_m.layers.*", "[!l]*", "head.w"]
NAMES = ["layers.0.w", "layers.1.bias", "layers.10.w", "head.w", "a[", "a\\x", "x\ny", "b.w", "adam_m.layers.0.w",
         "", "lxyers.2", "zz"]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_answers_as_fnmatch_does_for_every_combination(size):
    for patterns in itertools.combinations(PATTERNS, size):
        matcher = NamePatterns(patterns)
        for name in NAMES:
            assert matcher.matches(name) == any(fnmatch.fnmatchcase(name, p) for p in patterns), (patterns, name)
        assert matcher.unmatched(NAMES[3:]) == [p for p in patterns
                                                if not any(fnmatch.fnmatchcase(n, p) for n in NAMES[3:])]


def test_random_patterns_and_names_agree_with_fnmatch():
    rng = random.Random(7)

    def text(chars, most):
        return "".join(rng.choice(chars) for _ in range(rng.randint(0, most)))

    for _ in range(2000):
        patterns = [text("ab.*?[]!\\", 5) or "a" for _ in range(rng.randint(1, 5))]
        names = [text("ab.[]\\*", 6) for _ in range(rng.randint(0, 6))]
        matcher = NamePatterns(patterns)
        assert [matcher.matches(n) for n in names] == [any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in names]
        assert matcher.unmatched(names) == [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
