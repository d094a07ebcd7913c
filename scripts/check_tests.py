"""Check that the graded tests catch the wrong-solution catalog (staff only).

    python scripts/check_tests.py [--problem NAME ...] [--quick] [-j WORKERS] [--out catalog.json]

Each entry of assignments/staff/wrong_solutions/ is planted in a copy of the reference and graded as
a submission: it must cost its own problem points and no other problem any. Prints a table per problem
(entries, caught, leaked, kill rate) and the entries that fail; exit status 1 if any does.
--quick runs only each entry's own problem (no check for leaks).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cs336_grading import catalog  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", action="append", help="only this problem's entries (repeatable)")
    parser.add_argument("--quick", action="store_true", help="grade only each entry's own problem")
    parser.add_argument("-j", type=int, default=2, help="grading runs at a time (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the verdicts as JSON")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    try:
        entries = catalog.load(repo)
    except catalog.CatalogError as e:
        print(f"check_tests: error: {e}", file=sys.stderr)
        return 2
    if args.problem:
        entries = [e for e in entries if e.problem in args.problem]
    start, done = time.perf_counter(), []

    def progress(v):
        done.append(v)
        status = "ok" if v.ok else ("ERROR" if v.error else "NOT CAUGHT" if not v.caught else "LEAKED")
        print(
            f"[{len(done)}/{len(entries)} {time.perf_counter() - start:5.0f}s] {v.entry.id}: {status}",
            flush=True,
        )

    verdicts = list(catalog.check(repo, entries, workers=args.j, only_own=args.quick, progress=progress))
    print("\n".join(catalog.summary(verdicts)))
    if args.out:
        rows = [
            {
                "problem": v.entry.problem,
                "name": v.entry.name,
                "mistake": v.entry.mistake,
                "caught": v.caught,
                "leaked": v.leaked,
                "error": v.error,
                "lost": {p: list(s) for p, s in v.lost.items()},
            }
            for v in verdicts
        ]
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(v.ok or (args.quick and v.caught) for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
