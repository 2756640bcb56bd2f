"""bench/RESULTS.md is what bench/report.py makes of bench/results/, and every result file is named by the rule."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def test_results_page_is_generated(tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text(report.render(report.load()))
    assert (ROOT / "bench" / "RESULTS.md").read_text() == out.read_text(), \
        "bench/RESULTS.md is stale: run `python bench/report.py`"


def test_result_files_follow_the_naming_rule():
    files = sorted((ROOT / "bench" / "results").rglob("*.json"))
    assert files
    for path in files:
        rel = path.relative_to(ROOT / "bench" / "results")
        assert len(rel.parts) == 3, f"{rel}: expected <bench>/<device>/<date>-<commit>.json"
        match = report.NAME.match(path.name)
        assert match, f"{rel}: expected <date>-<commit7>[-n].json"
        result = report.normalise(json.loads(path.read_text()))
        assert result["date"] == match.group(1), rel
        assert result["commit"][:7] == match.group(2) or match.group(2) == "unknown" == result["commit"], rel
        assert rel.parts[1] in (result["device"], f"cpu-{result['device']}"), rel


def test_every_target_names_a_benchmark_and_a_comparison():
    for bench, _, _, op, _, issue in report.TARGETS:
        assert bench in report.BENCHES and op in report.COMPARE and issue
