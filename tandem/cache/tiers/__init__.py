"""The resident prefix's tiers, one pure core each: the grid anchors, the ends (the end anchor
and the prompt-end anchor), the guest stash, the pinned head and the parked session.

Each core holds its copies and the bytes they take at its memory level, and checks its own
invariants (``check_invariants``). None touches the engine: what a tier copies from or writes
back into the live state is done by the composer (tandem/cache/resident.py), which decides
between the tiers' offers.
"""
