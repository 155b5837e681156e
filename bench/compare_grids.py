"""Compares the GPU grid reports of a run with the recorded cases in bench/results, case by case.

A kernel change that moves no arithmetic must reproduce every recorded case exactly: errors, bounds and
ratios to the last bit (timings aside). The reports are the files the GPU tests write where
RDNA_FA_GRID_REPORT, RDNA_FA_BWD_GRID_REPORT and RDNA_FA_PROBLEM_GRID_REPORT point (bench/gpu_kernel_checks.sh
writes all three); a run split over several calls (one per emulated layer) passes all its folders, and
only the recorded cases of the layers they hold are compared.

    python3 -m bench.compare_grids OUT_DIR [OUT_DIR ...]
    python3 -m bench.compare_grids --baseline BEFORE_DIR AFTER_DIR   # two runs of one call, before and after a change

Exit status 1 when a grid differs from the record, holds no case, or no report is found. A folder
per layer: two folders with the same layer count its cases twice.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GRIDS = {  # the report a run writes -> the recorded cases
    "forward_grid.json": "forward_grid_cases.json.gz",
    "backward_grid.json": "backward_grid_cases.json.gz",
    "problem_grids.json": "problem_grids_cases.json.gz",
}
UNTIMED = frozenset({"seconds"})


def _case_key(case: dict) -> str:
    return json.dumps({k: v for k, v in case.items() if k not in UNTIMED}, sort_keys=True)


def compare(report_cases: list[dict], recorded_cases: list[dict]) -> dict:
    """Counts of the run's cases, the recorded ones of the same layers, and those only one side has."""
    layers = {case.get("layer") for case in report_cases}
    recorded = [case for case in recorded_cases if case.get("layer") in layers]
    ran, kept = collections.Counter(map(_case_key, report_cases)), collections.Counter(map(_case_key, recorded))
    return {"cases": len(report_cases), "recorded": len(recorded), "layers": sorted(map(str, layers)),
            "only_in_run": sum((ran - kept).values()), "only_in_record": sum((kept - ran).values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="folders holding a run's grid reports")
    parser.add_argument("--baseline", type=Path,
                        help="compare with this run's reports (a renovation's 'before') instead of the recorded cases")
    args = parser.parse_args(argv)
    found, same = 0, True
    for report_name, record_name in GRIDS.items():
        reports = [run / report_name for run in args.runs if (run / report_name).exists()]
        if not reports:
            continue
        found += 1
        cases = [case for path in reports for case in json.loads(path.read_text())["cases"]]
        if args.baseline:
            baseline = args.baseline / report_name
            recorded = json.loads(baseline.read_text())["cases"] if baseline.exists() else []
        else:
            recorded = json.loads(gzip.decompress((RESULTS / record_name).read_bytes()))
        result = compare(cases, recorded)
        identical = result["cases"] > 0 and result["only_in_run"] == result["only_in_record"] == 0
        same = same and identical
        print(f"{report_name}: {result['cases']} cases, {result['recorded']} recorded for layers "
              f"{', '.join(result['layers'])}: " + ("identical" if identical else "nothing ran" if not result["cases"]
              else f"{result['only_in_run']} only in the run, {result['only_in_record']} only in the record"))
    if not found:
        print("no grid report found in " + ", ".join(map(str, args.runs)))
    return 0 if found and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
