"""Check that the graded tests catch the wrong-solution catalog (staff only).

    python scripts/check_tests.py [--problem NAME ...] [--quick] [--every-test] [-j WORKERS] [--out FILE]

Each entry of assignments/staff/wrong_solutions/ is planted in a copy of the reference and graded as
a submission: it must cost its own problem points and no other problem any. Prints a table per problem
(entries, caught, leaked, kill rate) and the entries that fail; exit status 1 if any does.
One process imports everything once and grades each entry in a forked child, on the graded tests that
the entry can affect (cs336_grading/catalog.py says which); --every-test runs them all for every entry,
--quick only each entry's own problem's (no check for leaks).
"""

import argparse
import json
import sys
import time
from pathlib import Path

from cs336_grading import catalog
from cs336_grading.grader import GradeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", action="append", help="only this problem's entries (repeatable)")
    parser.add_argument("--quick", action="store_true", help="grade only each entry's own problem")
    parser.add_argument("--every-test", action="store_true", help="run every graded test for every entry")
    parser.add_argument("-j", type=int, default=2, help="entries graded at a time (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the verdicts as JSON")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    try:
        entries = catalog.load(repo)
    except catalog.CatalogError as e:
        print(f"check_tests: error: {e}", file=sys.stderr)
        return 2
    if args.problem:
        unknown = sorted(set(args.problem) - {e.problem for e in entries})
        if unknown:
            print(f"check_tests: error: no catalog entry for problem {unknown[0]!r}", file=sys.stderr)
            return 2
        entries = [e for e in entries if e.problem in args.problem]
    start, done = time.perf_counter(), []

    def progress(v):
        done.append(v)
        wrong = ["ERROR"] if v.error else ["NOT CAUGHT"] * (not v.caught) + ["LEAKED"] * bool(v.leaked)
        status = " and ".join(wrong) or "ok"
        print(
            f"[{len(done)}/{len(entries)} {time.perf_counter() - start:5.0f}s] {v.entry.id}: {status} "
            f"({v.tests} tests, {v.seconds:.1f} s)",
            flush=True,
        )

    try:
        verdicts = list(
            catalog.check(
                repo,
                entries,
                workers=args.j,
                only_own=args.quick,
                progress=progress,
                every_test=args.every_test,
            )
        )
    except GradeError as e:
        print(f"check_tests: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(catalog.summary(verdicts)))
    print(f"checked in {time.perf_counter() - start:.0f} s")
    if args.out:
        rows = [
            {
                "problem": v.entry.problem,
                "name": v.entry.name,
                "mistake": v.entry.mistake,
                "caught": v.caught,
                "leaked": v.leaked,
                "error": v.error,
                "failed": v.failed,
                "lost": {p: list(s) for p, s in v.lost.items()},
            }
            for v in verdicts
        ]
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(v.ok or (args.quick and v.caught) for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
