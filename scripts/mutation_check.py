"""Run the cache tests under each broken restore and name the survivors (issue 12, part 7).

For each mutation in tests/mutations.py (a restore that skips the recurrent sections, the conv
tails or the view rows, or scales the sections by 1.001) the cache tests run in a pytest
subprocess with the restores mutated. A test that passes is a survivor:

- a survivor whose mutated restores changed the state (``hit``) let a broken restore through:
  it must be strengthened, and the script exits 1;
- a survivor without a hit restored nothing the mutation could change (it tests something
  else: stats, room, hashing, or a restore of a copy equal to the state in place); it is listed.

    PYTHONPATH=$PWD python scripts/mutation_check.py [-k EXPR] [--json FILE] [PATHS...]

Runs on two cores in a few minutes (five runs of the cache tests: one clean, four mutated).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mutations import NAMES  # noqa: E402

CACHE_TESTS = ["tests/cache", "tests/engine/test_engine_resume.py"]


def run(mutation: str, paths: list[str], keyword: str | None) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, TANDEM_MUTATION=mutation, TANDEM_MUTATION_REPORT=str(report),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                               os.environ.get("PYTHONPATH", "")]))
        # test_mutations applies the mutations itself: under a whole-run one it proves nothing.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutations",
               "--ignore=tests/cache/test_mutations.py", "-x" if mutation == "none" else "-q",
               *paths]
        if keyword:
            cmd += ["-k", keyword]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if not report.exists():
            sys.exit(f"pytest wrote no report under {mutation}:\n{proc.stdout}\n{proc.stderr}")
        out = json.loads(report.read_text())
    if mutation == "none" and proc.returncode != 0:
        sys.exit(f"the cache tests fail without a mutation:\n{proc.stdout[-4000:]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=CACHE_TESTS)
    ap.add_argument("-k", dest="keyword")
    ap.add_argument("--json", help="write {mutation: {test: outcome}} here")
    args = ap.parse_args()
    clean = run("none", args.paths, args.keyword)
    tests = sorted(t for t, r in clean.items() if r["outcome"] == "passed")
    print(f"{len(tests)} cache tests pass without a mutation")
    results, weak = {}, 0
    for mutation in NAMES:
        outcome = run(mutation, args.paths, args.keyword)
        results[mutation] = outcome
        survived = [t for t in tests if outcome.get(t, {}).get("outcome") == "passed"]
        hit = [t for t in survived if outcome[t]["hit"]]
        weak += len(hit)
        print(f"\n{mutation}: {len(tests) - len(survived)} fail, {len(survived)} survive "
              f"({len(hit)} of them restored state the mutation changed)")
        for t in survived:
            print(f"  {'WEAK ' if outcome[t]['hit'] else 'nohit'} {t}")
    never = [t for t in tests if all(results[m][t]["outcome"] == "passed" for m in NAMES)]
    print(f"\n{len(never)} tests survive every mutation; "
          f"{weak} survivals let a changed restore through")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 1 if weak else 0


if __name__ == "__main__":
    sys.exit(main())
