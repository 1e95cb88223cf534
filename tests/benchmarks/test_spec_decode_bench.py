"""benchmarks/spec_decode_bench.py in its smoke configuration (2 layers, 16 tokens, one rep):
in float32 every spec run's tokens equal the no-spec run's, the spec counters moved, and the
printed table holds a positive ratio for every row. No timed assertion."""

import re

from spec_decode_bench import main


def test_spec_decode_bench_quick(capsys):
    totals = main(["--quick", "--dtype", "float32", "--batch", "4"])
    out = capsys.readouterr().out
    cases = {case for case, _ in totals}
    methods = {method for _, method in totals}
    assert cases == {
        "copy x1 greedy",
        "copy x4 greedy",
        "free x1 greedy",
        "free x4 greedy",
        "copy x1 T=0.8 seeded",
    }
    assert methods == {"no spec", "ngram k=4", "self:1 k=3"}
    for (case, method), t in totals.items():
        assert t.mismatches == [], (case, method)  # float32: the verifier is exact
        assert t.tokens > 0 and t.seconds > 0 and t.steps > 0
        assert t.output_tokens == totals[(case, "no spec")].output_tokens
        if method == "no spec":
            assert t.drafts == t.draft_tokens == 0
        else:
            assert 0 <= t.accepted <= t.draft_tokens and t.drafts > 0
    # The copy prompt repeats its paragraph: prompt lookup finds drafts that get accepted.
    assert totals[("copy x1 greedy", "ngram k=4")].accepted > 0

    rows = [line for line in out.splitlines() if re.match(r"^(copy|free) x\d", line)]
    assert len(rows) == len(totals)
    for line in rows:
        ratio = float(re.search(r" (\d+\.\d+)x ", line).group(1))
        assert ratio > 0, line
        assert line.rstrip().endswith("yes"), line
