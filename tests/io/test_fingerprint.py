"""The tier's fingerprint (v3 over the manifest, fp4 over the extra by content) and its adoption
of the files earlier formulas wrote for the same rows (fp-equal.json, disk_adopt_from)."""

import json
import os
import shutil

import msgspec
import torch
from safetensors.torch import save_file

from tandem.cache.namespace import SHARED
from tandem.engine import Engine
from tandem.io.chain import chain_keys
from tandem.io.fingerprint import (RECORD, AdoptionRecord, FingerprintInputs, FormulaRecord,
                                   Identity, adopt, content_digest, fingerprint,
                                   legacy_fingerprints, tier_identity)
from tandem.io.tierfile import TierFiles
from tandem.io.tierindex import scan
from tandem.models.third import ThirdModel

from tier_rig import GRID, tokens, write_prompt

MANIFEST = {"model_type": "hybrid", "dtype": "torch.bfloat16", "weights": "w1", "code": "c1",
            "prefix_chunk": "1024", "num_threads": "16"}
MiB = 1 << 20


def _checkpoint(path, seed: int = 0):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    gen = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(16, 8, generator=gen)}, str(path / "model.safetensors"))
    return path


def test_each_part_of_the_manifest_changes_the_fingerprint():
    base = fingerprint(FingerprintInputs(MANIFEST))
    for name in MANIFEST:
        other = dict(MANIFEST, **{name: MANIFEST[name] + "x"})
        assert fingerprint(FingerprintInputs(other)) != base, name
    assert fingerprint(FingerprintInputs(dict(MANIFEST, extra_item="1"))) != base
    versions = FingerprintInputs(MANIFEST).versions
    assert "torch" in versions
    assert fingerprint(FingerprintInputs(MANIFEST, versions=dict(versions, torch="0"))) != base


def test_the_engines_manifest_fingerprints_the_grid_and_the_threads(hybrid, hybrid_dir):
    def fp(**kw):
        manifest = Engine(hybrid, window=256, **kw).manifest()
        return fingerprint(FingerprintInputs.of_checkpoint(manifest, hybrid_dir))

    base = fp(prefix_chunk=64)
    assert fp(prefix_chunk=64) == base
    assert fp(prefix_chunk=128) != base
    threads = torch.get_num_threads()
    try:
        assert fp(prefix_chunk=64, num_threads=1 if threads != 1 else 2) != base
    finally:
        torch.set_num_threads(threads)


def test_fp4_counts_a_weight_file_by_content_and_v3_by_path(tmp_path):
    tree = _checkpoint(tmp_path / "tree")
    inputs = FingerprintInputs.of_checkpoint(MANIFEST, tree)
    fp4, v3 = fingerprint(inputs, "fp4"), fingerprint(inputs, "v3")
    # a byte changed, the size kept: fp4 sees it, v3 (name and size) does not
    raw = bytearray((tree / "model.safetensors").read_bytes())
    raw[-3] ^= 1
    (tree / "model.safetensors").write_bytes(bytes(raw))
    assert fingerprint(inputs, "fp4") != fp4 and fingerprint(inputs, "v3") == v3
    raw[-3] ^= 1
    (tree / "model.safetensors").write_bytes(bytes(raw))
    # the same bytes in another folder: fp4 keeps its files, v3 does not
    moved = shutil.copytree(tree, tmp_path / "moved")
    there = FingerprintInputs.of_checkpoint(MANIFEST, moved)
    assert fingerprint(there, "fp4") == fp4 and fingerprint(there, "v3") != v3


def test_a_setting_that_names_a_file_counts_by_what_is_in_it(tmp_path):
    table = tmp_path / "tiles.json"
    table.write_text('{"a": 1}')
    inputs = FingerprintInputs(MANIFEST, extra={"TABLE": str(table), "FLAG": "1"})
    fp4 = fingerprint(inputs)
    moved = tmp_path / "other.json"
    shutil.copy(table, moved)
    assert fingerprint(FingerprintInputs(MANIFEST, extra={"TABLE": str(moved), "FLAG": "1"})) \
        == fp4
    table.write_text('{"a": 2}')
    assert fingerprint(inputs) != fp4
    assert fingerprint(FingerprintInputs(MANIFEST, extra={"TABLE": str(table), "FLAG": "0"})) \
        != fingerprint(inputs)


def test_a_file_over_64_mib_counts_by_its_first_and_last_mib_and_16_reads_between(tmp_path):
    path = tmp_path / "big.bin"
    size = 80 * MiB
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the test writes a few bytes, not 80 MiB

    def poke(at: int) -> str:
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(b"\1")
        digest = content_digest(path)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(b"\0")
        return digest

    base = content_digest(path)
    assert base.startswith(f"{size}:")
    span = size - 3 * MiB
    sampled = [0, MiB - 1, size - 1, MiB + span * 7 // 15 + 5]
    assert all(poke(at) != base for at in sampled)
    # between two reads: the cost of sampling (fp4 pairs it with the size and the header)
    assert poke(MiB + span * 7 // 15 + 2 * MiB) == base
    with open(path, "r+b") as f:
        f.truncate(size + 1)
    assert content_digest(path) != base


# -- adoption -------------------------------------------------------------------------------

def _write_under(files, fp: str, seed: int):
    model = ThirdModel()
    prompt = tokens(model.vocab_size, GRID, seed)
    write_prompt(files, model, prompt, [GRID], fingerprint=fp)
    return chain_keys(prompt, GRID, SHARED)[0]


def test_the_first_start_under_fp4_adopts_the_v3_files_of_the_same_tree_once(tmp_path):
    tree = _checkpoint(tmp_path / "tree")
    inputs = FingerprintInputs.of_checkpoint(MANIFEST, tree)
    v3 = fingerprint(inputs, "v3")
    with TierFiles(tmp_path / "tier") as files:
        old = _write_under(files, v3, 1)
        stranger = _write_under(files, "ee" * 32, 2)
        identity = tier_identity(files, inputs)
        assert identity.fingerprint == fingerprint(inputs, "fp4") and v3 in identity
        index, report = scan(files, identity, GRID)
        assert set(index.chunks) == {old} and report.other_fingerprint == 2
        assert not files.path("chunk", stranger).exists()
        record = msgspec.json.decode(files.read_record(RECORD), type=AdoptionRecord)
        assert record.formulas["fp4"] == FormulaRecord(identity.fingerprint, [v3])
        # a later start under the same fingerprint reads them still
        assert tier_identity(files, inputs) == identity
        # an arithmetic change under fp4 sweeps them: the rows of another arithmetic
        changed = FingerprintInputs.of_checkpoint(dict(MANIFEST, code="c2"), tree)
        after = tier_identity(files, changed)
        assert after.adopted == frozenset() and v3 not in after
        index, report = scan(files, after, GRID)
        assert not index.chunks and report.other_fingerprint == 2


def test_a_moved_tree_adopts_the_folder_it_came_from_only_when_named_and_equal(tmp_path):
    old_tree = _checkpoint(tmp_path / "tandem-live")
    new_tree = shutil.copytree(old_tree, tmp_path / "tandem-rc")
    old_v3 = fingerprint(FingerprintInputs.of_checkpoint(MANIFEST, old_tree), "v3")
    inputs = FingerprintInputs.of_checkpoint(MANIFEST, new_tree)
    here, named = legacy_fingerprints(inputs)
    assert old_v3 not in here and named == []
    here, named = legacy_fingerprints(inputs, adopt_from=[str(old_tree)])
    assert named == [old_v3]
    # a folder whose checkpoint holds other bytes is not adopted
    other_tree = _checkpoint(tmp_path / "other", seed=5)
    assert legacy_fingerprints(inputs, adopt_from=[other_tree]) == (here, [])
    with TierFiles(tmp_path / "tier") as files:
        key = _write_under(files, old_v3, 3)
        identity = tier_identity(files, inputs, disk_adopt_from=[old_tree])
        assert old_v3 in identity
        index, _ = scan(files, identity, GRID)
        assert set(index.chunks) == {key}
    with TierFiles(tmp_path / "tier2") as files:
        key = _write_under(files, old_v3, 3)
        identity = tier_identity(files, inputs)  # not named: swept
        index, _ = scan(files, identity, GRID)
        assert not index.chunks


def test_a_formulas_record_passes_on_what_the_formula_before_it_had_adopted():
    record = AdoptionRecord({"v3": FormulaRecord("v3-here", ["v2-here"])})
    identity, new = adopt(record, "fp4", "fp4-here", legacy=["v3-here"], named=[])
    assert identity == Identity("fp4-here", frozenset({"v3-here", "v2-here"}))
    assert new.formulas["v3"] == record.formulas["v3"]  # each formula keeps its own record
    # a record of another tree's v3 passes nothing on
    identity, _ = adopt(AdoptionRecord({"v3": FormulaRecord("v3-elsewhere", ["v2-x"])}),
                        "fp4", "fp4-here", legacy=["v3-here"], named=[])
    assert identity.adopted == frozenset({"v3-here"})


def test_the_adoption_record_is_private_and_an_unreadable_one_is_rewritten(tmp_path):
    inputs = FingerprintInputs(MANIFEST)
    with TierFiles(tmp_path / "tier") as files:
        (tmp_path / "tier" / RECORD).write_bytes(b"not json")
        identity = tier_identity(files, inputs)
        assert identity.fingerprint == fingerprint(inputs)
        assert os.stat(tmp_path / "tier" / RECORD).st_mode & 0o777 == 0o600
        msgspec.json.decode(files.read_record(RECORD), type=AdoptionRecord)
