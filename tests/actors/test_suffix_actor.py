"""The suffix store actor: appends and rebuilds on its own thread, the index swapped in whole, a
rest between rebuilds that scales with the last one, and a refused store that never stops the
system."""

from functools import partial

from tandem.actors.harness import Harness
from tandem.actors.suffix import REBUILD_REST, SuffixActor, SuffixAppend
from tandem.cache.suffix import PersistentSuffixStore

SHA = "a" * 64


def system(tmp_path, sha=SHA):
    harness = Harness()
    actor = harness.add(SuffixActor("suffix", open_store=partial(
        PersistentSuffixStore, tmp_path / "suffix", tokenizer_sha256=sha), clock=harness.clock))
    return harness, actor


async def test_an_append_is_indexed_and_drafts_from_it(tmp_path):
    harness, actor = system(tmp_path)
    async with harness:
        await harness.ask("suffix", SuffixAppend([1, 2, 3, 4, 5, 6], [7, 8, 9]))
        await actor.wait_indexed()
        report = actor.report()
        assert report["state"] == "open" and report["indexed_tokens"] == report["tokens"] == 10
        assert actor.store.lookup([3, 4, 5], 3) == [6, 7, 8]


async def test_rebuilds_rest_in_proportion_to_the_last_one(tmp_path):
    harness, actor = system(tmp_path)
    clock = harness.clock
    async with harness:
        store = actor.store
        build = store.build_index

        def slow_build():
            index = build()
            clock._now_s += 2.0  # the sort took two seconds
            if store.num_tokens < 20:  # a turn lands while the first build runs
                store.add_request([11, 12, 13, 14, 15, 16, 17, 18, 19], [21])
            return index

        store.build_index = slow_build
        await harness.ask("suffix", SuffixAppend([1, 2, 3, 4, 5, 6], [7, 8, 9]))
        await clock.until_sleeping(1)
        assert store.rebuilds == 1 and store.index.num_tokens < store.num_tokens
        clock.advance(2.0 * REBUILD_REST - 0.1)
        assert store.rebuilds == 1
        clock.advance(0.1)
        await actor.wait_indexed()
        assert store.rebuilds == 2 and store.index.num_tokens == store.num_tokens


async def test_a_store_of_another_tokenizer_is_refused_and_appends_are_dropped(tmp_path):
    harness, actor = system(tmp_path)
    async with harness:
        await harness.ask("suffix", SuffixAppend([1, 2, 3], [4]))
    before = (tmp_path / "suffix" / "tokens.u32").read_bytes()
    harness, actor = system(tmp_path, sha="b" * 64)
    async with harness:
        report = actor.report()
        assert report["state"] == "refused" and "tokenizer" in report["reason"]
        await harness.ask("suffix", SuffixAppend([5, 6, 7], [8]))
    assert (tmp_path / "suffix" / "tokens.u32").read_bytes() == before


async def test_an_append_whose_file_write_fails_is_dropped_and_the_store_goes_on(tmp_path):
    """A full disk, or the store's folder deleted under the server: that request's tokens are
    not kept, nothing of them is, and the actor (hence the system) and the next append go on."""
    import errno
    import shutil

    harness, actor = system(tmp_path)
    async with harness:
        await harness.ask("suffix", SuffixAppend([1, 2, 3, 4, 5, 6], [7, 8, 9]))
        store = actor.store
        write = store._append_file

        def full(tokens):
            raise OSError(errno.ENOSPC, "No space left on device")

        store._append_file = full
        await harness.ask("suffix", SuffixAppend([31, 32, 33, 34, 35, 36], [37]))
        assert store.num_tokens == 10 and actor.report()["append_failures"] == 1
        store._append_file = write
        shutil.rmtree(tmp_path / "suffix")  # the folder gone: open() raises FileNotFoundError
        await harness.ask("suffix", SuffixAppend([41, 42, 43, 44, 45, 46], [47]))
        assert actor.report()["append_failures"] == 2 and actor.report()["state"] == "open"
        (tmp_path / "suffix").mkdir()
        await harness.ask("suffix", SuffixAppend([31, 32, 33, 34, 35, 36], [37]))
        await actor.wait_indexed()
        assert store.lookup([33, 34, 35], 2) == [36, 37]
