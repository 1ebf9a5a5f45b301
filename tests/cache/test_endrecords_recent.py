"""The recent turns' records (tandem/cache/endrecords.py EndRecords.recent): a copy that aligns
with no end in place is aligned with each of them on every request, so the same turn sent
again (a chat UI's title and tags requests, a retry, a prompt sent twice) keeps one record,
the newest, where it used to fill the deque with copies of itself."""

from tandem.cache.endalign import EndRecord
from tandem.cache.endrecords import RECENT, EndRecords


def _records() -> EndRecords:
    return EndRecords(None, lambda t: b"t%d" % t, store_backed=True)


def test_the_same_turn_again_keeps_one_record_the_newest():
    ends = _records()
    served = list(range(1000, 1400))
    previous = None
    for _ in range(5):  # the prompt sent again: each repeat's record extends the last
        record = EndRecord.after_turn(previous, served, [])
        ends._keep_recent("a", record)
        previous = record
    assert len(ends.recent) == 1 and ends.recent[-1][1] is previous
    other = EndRecord.after_turn(None, served + [7], [8, 9])
    ends._keep_recent("a", other)
    assert [r for _, r in ends.recent] == [previous, other]
    # the first turn again: its older copy leaves, the newest is last
    again = EndRecord.after_turn(previous, served, [])
    ends._keep_recent("a", again)
    assert [r for _, r in ends.recent] == [other, again]


def test_records_of_other_rows_namespaces_or_hidden_spans_are_all_kept():
    ends = _records()
    rows = list(range(50, 90))
    ends._keep_recent("a", EndRecord(rows))
    ends._keep_recent("b", EndRecord(rows))  # another tenant's: its own snapshot
    ends._keep_recent("a", EndRecord(rows, hidden=[(3, 5)]))
    ends._keep_recent("a", EndRecord(rows[:-1] + [1]))
    assert len(ends.recent) == 4
    for i in range(RECENT + 3):
        ends._keep_recent("a", EndRecord(rows + [i]))
    assert len(ends.recent) == RECENT  # still a bounded deque


def test_a_turn_with_no_generated_row_adds_no_region():
    """max_tokens 1 leaves the one token out of the rows: the turn's region would be empty, and
    a prompt sent again and again grew its record by one such region a request."""
    served = list(range(1000, 1050))
    record = EndRecord.after_turn(None, served, [])
    for _ in range(20):
        record = EndRecord.after_turn(record, served, [])
    assert record.regions == [] and record.rows == served
    turn = EndRecord.after_turn(record, served + [5], [6, 7])
    assert [(r.start, r.stop) for r in turn.regions] == [(51, 53)]
    again = EndRecord.after_turn(turn, turn.rows, [])
    assert again.regions == turn.regions
