"""bench.equivalence's comparison names each answer that differs and where it parts."""

from bench.equivalence import compare


def test_compare_counts_agreement_and_names_each_difference():
    record = compare(
        "batched vs one at a time",
        ["x ^ { 2 }", "\\alpha", "a + b"],
        ["x ^ { 3 }", "\\alpha", "a + b + c"],
        batch_size=4,
    )
    assert record["identical"] == 1
    assert record["identical_share"] == 0.3333
    assert record["batch_size"] == 4
    assert record["differences"] == [
        {"image": 0, "left": "x ^ { 2 }", "right": "x ^ { 3 }", "parts_at_token": 3},
        {"image": 2, "left": "a + b", "right": "a + b + c", "parts_at_token": 3},
    ]


def test_compare_of_equal_answers_lists_no_difference():
    record = compare("streamed vs batched", ["a", "b"], ["a", "b"])
    assert (record["identical"], record["differences"]) == (2, [])
