"""`python -m benchmarks.run --only X` replaces X's section in the results file, keeps the rest."""

from __future__ import annotations

from benchmarks.run import _chosen, _merge


def test_only_run_replaces_its_section_and_keeps_the_others() -> None:
    old = "# header old\n\n## A\n\nold a\n\n## B\n\nold b\n"
    merged = "\n".join(_merge(old, ["# header new\n", "## B\n\nnew b\n", "## C\n\nnew c\n"]))
    assert merged.startswith("# header new\n")
    assert "old a" in merged and "new b" in merged and "new c" in merged
    assert "old b" not in merged
    assert merged.index("## A") < merged.index("## B") < merged.index("## C")


def test_only_names_a_module_exactly_before_by_suffix() -> None:
    assert _chosen(["vllm"]) == ["benchmarks.bench_vllm"]
    assert _chosen(["trace_vllm"]) == ["benchmarks.bench_trace_vllm"]
    assert _chosen(["ncy"]) == ["benchmarks.bench_concurrency"]
    assert _chosen(["traffic", "hashing"]) == [
        "benchmarks.bench_hashing",
        "benchmarks.bench_traffic",
    ]
    assert _chosen(None)[-3:] == [
        "benchmarks.bench_trace_vllm",
        "benchmarks.bench_traffic",
        "benchmarks.bench_pd",
    ]
