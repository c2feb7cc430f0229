"""The planner against torchtitan's context-parallel runs (``benchmarks/context_parallel_planner.py``): every run
priced as torchtitan ran it fits, and RESULTS.md's section holds Table 2's ratios against their target and Table 6's
beside them (the ratios' own targets are asserted in ``tests/parallel/test_planner.py``)."""

from tests.launch import benchmark_modules

context_planner, run_all = benchmark_modules("context_parallel_planner", "run_all")  # run_all: RESULTS.md's sections


def test_both_tables_are_priced_as_torchtitan_ran_them_and_only_table_2_is_a_target():
    rows, rows_405b = context_planner.runs(), context_planner.runs("405b")
    assert [(r["cp"], r["seq_len"]) for r in rows_405b] == list(context_planner.PUBLISHED_405B)
    assert all(r["fits"] for r in rows + rows_405b)
    assert all("pp=8 tp=8" in r["layout"] and "zero=3" in r["layout"] and "m=8" in r["layout"] for r in rows_405b)
    # the sequence-length ratios fall with cp in both tables, published and predicted alike
    for ratios in (context_planner.ratios(rows), context_planner.ratios(rows_405b)):
        assert all(r["published"] < 1 and r["predicted"] < 1 for r in ratios)
    section = run_all.context_planner_section({
        "runs": rows, "ratios": context_planner.ratios(rows), "runs_405b": rows_405b,
        "ratios_405b": context_planner.ratios(rows_405b)})
    assert section.count("within 25% (") == len(rows) + len(rows) - 3  # Table 2's five ratios, Table 6's none
    assert "Table 6, Llama 3.1 405B on 512 H100s" in section and "| cp=8, 256K | 16 |" in section
    # every rank holds 32K tokens in each of Table 2's runs: the published step grows past what its FLOPs do
    assert ("Every rank holds 32,768 tokens of a sequence in each run, so the published step time grows as its"
            " tokens/s fall: 1.53× from 32K to 64K, 2.37× from 64K to 128K, 1.95× from 128K to 256K.") in section
    assert "A step growing 2.37× is more than compute and the exchange explain" in section
