"""Grade a submission with this checkout's graded tests, reference outputs and rubric.

    python scripts/grade.py [--submission DIR] [--problem NAME] [--out results.json] [-k EXPR] [-n WORKERS]
    python scripts/grade.py --write-rubric          # staff: regenerate assignments/rubric.json

Each problem's graded tests run with the submission's functions for that problem and this checkout's
code for everything else, so a bug costs only its own problem's points. Without --submission the
checkout grades itself as it is (a student's local preview: no isolation, the student's code throughout).
The tests and reference outputs are always this checkout's; the maximum is the rubric's total.
Writes Gradescope's results.json and prints a table ending with 'TOTAL: x / y'.
"""

import argparse
import json
import sys
from pathlib import Path

from cs336_grading.grader import TIMEOUT, GradeError, results_json, run_graded, summary_lines, write_rubric
from cs336_grading.rubric import RUBRIC, RubricError, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parents[1]
    parser.add_argument("--submission", type=Path, default=None, help="checkout to grade (default: this one)")
    parser.add_argument("--out", type=Path, default=Path("results.json"), help="where to write results.json")
    parser.add_argument("--problem", action="append", help="grade only this problem (repeatable)")
    parser.add_argument("-k", default=None, help="only run graded tests matching this pytest -k expression")
    parser.add_argument("-n", type=int, default=0, help="pytest-xdist workers (0: none)")
    parser.add_argument(
        "--timeout", type=float, default=TIMEOUT, help=f"seconds a graded test may run (default {TIMEOUT:g})"
    )
    parser.add_argument("--write-rubric", action="store_true", help=f"regenerate {RUBRIC} from this checkout")
    args = parser.parse_args(argv)
    try:
        if args.write_rubric:
            rubric = write_rubric(here)
            print(f"wrote {RUBRIC}: {len(rubric['problems'])} problems, {rubric['total']} points")
            return 0
        if args.problem:
            unknown = sorted(set(args.problem) - set(load(here)["problems"]))
            if unknown:
                raise GradeError(f"unknown problem {unknown[0]!r}; see {RUBRIC}")
        extra = [f"--problem={p}" for p in args.problem or []]
        run = run_graded(
            here, args.submission, args.k, args.n, extra, problems=args.problem, timeout=args.timeout
        )
        args.out.write_text(json.dumps(results_json(run), indent=2) + "\n")
    except (GradeError, RubricError, OSError) as e:
        print(f"grade: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
