"""The benchmarks' one table printer: a markdown table that also lines up in a terminal."""

from minipaged.bench.common import Column, format_table


def test_a_markdown_table_with_numbers_right_aligned():
    rows = [
        {"system": "paged", "share": 0.973, "batch": 34.5},
        {"system": "contiguous-max", "share": 0.2, "batch": None},
    ]
    table = format_table(
        rows,
        [
            Column("system", "system"),
            Column("tokens", "share", "{:.1%}"),
            Column("x2", lambda r: 2 * r["share"], "{:.2f}x"),
            Column("batch", "batch", "{:.1f}"),
        ],
    )
    assert table.splitlines() == [
        "| system         | tokens |    x2 | batch |",
        "| :------------- | -----: | ----: | ----: |",
        "| paged          |  97.3% | 1.95x |  34.5 |",
        "| contiguous-max |  20.0% | 0.40x |     - |",
    ]


def test_a_column_of_words_numbers_or_bools_is_left_aligned():
    table = format_table([{"v": 1}, {"v": "n/a"}, {"v": True}], [Column("v", "v")])
    assert table.splitlines() == ["| v    |", "| :--- |", "| 1    |", "| n/a  |", "| True |"]
