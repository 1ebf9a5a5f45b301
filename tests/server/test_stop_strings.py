"""Stop strings: the incremental matcher cuts exactly where the naive one did, at a cost that
does not grow with a stop string's length."""

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.server.generation import StopStrings


class NaiveStopStrings:
    """The matcher as it was: every fed delta searches the text again and tries every end of
    it against every stop string (O(L^2) a token). The reference of the semantics."""

    def __init__(self, stops):
        self.stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._text = ""
        self._emitted = 0
        self.matched = False

    def feed(self, delta):
        self._text += delta
        if not self.stops:
            out, self._emitted = self._text[self._emitted:], len(self._text)
            return out
        start = max(0, self._emitted - self._longest + 1)
        hits = [i for s in self.stops if (i := self._text.find(s, start)) >= 0]
        if hits:
            out = self._text[self._emitted:min(hits)]
            self._emitted = len(self._text)
            self.matched = True
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self._text)), hold, -1):
                if s.startswith(self._text[-n:]):
                    hold = n
                    break
        end = max(self._emitted, len(self._text) - hold)
        out, self._emitted = self._text[self._emitted:end], end
        return out

    def flush(self):
        if self.matched:
            return ""
        out, self._emitted = self._text[self._emitted:], len(self._text)
        return out


def run(matcher, deltas):
    """What the server does with a matcher: feed until a stop matched, then flush."""
    out = []
    for delta in deltas:
        out.append(matcher.feed(delta))
        if matcher.matched:
            break
    out.append(matcher.flush())
    return out, matcher.matched


# A small alphabet, so that stop strings overlap, repeat and begin one another often.
text = st.text(alphabet="abc\n", max_size=12)


@settings(max_examples=600, deadline=None)
@given(stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=6), max_size=4),
       deltas=st.lists(text, max_size=12))
def test_the_incremental_matcher_emits_exactly_what_the_naive_one_did(stops, deltas):
    assert run(StopStrings(stops), deltas) == run(NaiveStopStrings(stops), deltas)


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_first_match():
    stops = StopStrings(["abcd", "bc"])
    assert stops.feed("xa") == "x"  # "a" may begin "abcd"
    assert stops.feed("bc") == "a" and stops.matched  # "bc" is complete; "abcd" is not
    stops = StopStrings(["abcd", "bc"])
    assert stops.feed("xabcd") == "x"  # both complete: the one that starts first cuts
    stops = StopStrings(["aab"])
    assert [stops.feed(c) for c in "aaaab"] == ["", "", "a", "a", ""] and stops.matched


def _builtin_calls(fn):
    """How many builtin calls ``fn`` makes (str.find, str.startswith, len, ...): a measure of
    work that does not depend on the machine."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "c_call":
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _feed_tokens(length):
    # Stops that the text never begins ("b" first, the text is all "a"): nothing is held, and
    # the naive matcher still tries every end of the text up to the stop's length.
    stops = StopStrings(["b" + "a" * (length - 1) for _ in range(16)])
    return _builtin_calls(lambda: [stops.feed("aaaa") for _ in range(400)])


def test_a_token_costs_the_same_whatever_the_stop_strings_length():
    # The finding: 16 stop strings of 100,000 characters froze the event loop for 16 s. The
    # work of a token must not depend on how long the stop strings are.
    assert _feed_tokens(1000) == _feed_tokens(10)
