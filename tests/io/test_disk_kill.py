"""kill -9 of a process writing the disk tier (issue 15, "Faults"), a few times: the driver of
scripts/disk_kill_check.py (hundreds of runs there), its coverage fixed here: a kill inside a
tier file's write, just before its rename, inside the counts file's write, inside the start's
scan and at a random moment. The gate after each: no ``.tmp`` after the next start, no torn
entry at a final name, the index the folder, every entry read back whole and torch.equal to the
cold prefill's, every usable anchor restored bit for bit (one continued to identical logits)."""

import sys
from pathlib import Path

import pytest

from tandem.io import tierfile
from tandem.io.tierfile import TierFiles
from tandem.models.third import ThirdModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from disk_kill_check import open_tier, run_check  # noqa: E402

# The stepped targets first: their kill points follow from the seed alone.
TARGETS = ["write", "rename", "counts", "start", "write", "rename", "drift", "drift"]


@pytest.fixture(scope="module")
def model():
    return ThirdModel()


def test_a_writer_killed_at_every_kind_of_point_leaves_no_torn_entry_and_no_leftover(
        tmp_path, model):
    summary = run_check(tmp_path / "tier", len(TARGETS), 15, model, targets=TARGETS)
    assert summary.failures == []
    assert summary.kills == summary.runs == len(TARGETS) and not summary.missed
    assert summary.mid_write >= 5  # write, rename, counts, write, rename
    assert summary.before_call["rename"] >= 2
    # each kill before a rename left a whole, fsynced .tmp: the start swept it, never kept it
    assert summary.leftovers_seen >= 2 and summary.leftovers_swept == summary.leftovers_seen
    assert summary.chunks_verified and summary.anchors_verified and summary.logits_gates


def _in_place():
    """A writer without its temp: each file is written at its final name (the bug the
    ``.tmp`` and rename exist to prevent)."""
    real = TierFiles._write

    def write(self, *args, **kwargs):
        tierfile.TMP = ""
        try:
            return real(self, *args, **kwargs)
        finally:
            tierfile.TMP = ".tmp"

    TierFiles._write = write


def test_the_check_finds_the_torn_entries_of_a_writer_that_writes_in_place(tmp_path, model):
    summary = run_check(tmp_path / "tier", 10, 15, model, targets=["write"],
                        writer_fault=_in_place)
    assert any("torn entry" in f for f in summary.failures), summary.failures


def test_a_start_deletes_the_counts_files_and_a_records_temp_left_in_the_root(tmp_path):
    """A kill inside the counts file's write left ``admission.counts.tmp`` beside the files,
    and the start kept it (found by the driver)."""
    root = tmp_path / "tier"
    open_tier(root).close()
    (root / "admission.counts.tmp").write_bytes(b"half the counts")
    (root / "fp-equal.json.tmp").write_bytes(b"{")
    (root / "admission.counts").write_bytes(b"kept")  # not a leftover: its reader decides
    tier = open_tier(root)
    assert tier.scanned.leftovers == 2
    assert sorted(p.name for p in root.iterdir()) == ["admission.counts"]
    assert not tier.files.leftovers()
