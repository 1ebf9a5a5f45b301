"""The disk tier under the day's write budget: every byte of the files it writes is added to the
guard's count; past the budget a plan is empty, the skip counted and journaled, nothing left
pending, and the lines still counted, so the next day writes what this one skipped."""

from datetime import datetime, timedelta

import structlog

from tandem.cache.namespace import SHARED
from tandem.io.admission import Admission
from tandem.io.fingerprint import Identity
from tandem.io.tier import DiskTier
from tandem.io.write_guard import GB, WriteGuard

from disk_rig import FP, GRID, Clock, head_plan, tokens, write_plan


class DayClock:
    def __init__(self):
        self.now = datetime(2026, 10, 3, 12).timestamp()

    def __call__(self) -> float:
        return self.now


def _tier(root, guard: WriteGuard, admit_after: int = 2) -> DiskTier:
    clock = Clock()
    admission = Admission(root / "admission.counts", grid=GRID, admit_after=admit_after,
                          head_anchors=4, min_tokens=0)
    return DiskTier(root, Identity(FP), GRID, admission=admission, budget_nbytes=1 << 40,
                    floor_nbytes=0, wall=clock.wall, monotonic=clock.monotonic, guard=guard)


def test_every_byte_of_the_files_the_tier_writes_is_added_to_the_days_count(tmp_path, model):
    root = tmp_path / "disk"
    guard = WriteGuard(root / "writes.json", 200.0, clock=DayClock())
    tier = _tier(root, guard)
    prompt = tokens(model.vocab_size, 3 * GRID + 5, 1)
    _, _, report = write_plan(tier, model, prompt, head_plan(tier, prompt))
    assert len(report.written) == 6
    on_disk = sum(tier.files.path(kind, key).stat().st_size for kind, key in tier.files.entries())
    r = guard.report()
    assert r["tier_nbytes"] == on_disk == tier.index.nbytes == report.nbytes
    assert r["spill_nbytes"] == 0 and r["level"] == "ok"
    tier.close()  # a close saves the count
    assert WriteGuard(root / "writes.json", 200.0, clock=DayClock()).today_nbytes() == on_disk


def test_past_the_budget_the_tier_plans_nothing_counts_the_skip_and_the_next_day_writes(
        tmp_path, model):
    root = tmp_path / "disk"
    clock = DayClock()
    guard = WriteGuard(root / "writes.json", 1.0, clock=clock)
    tier = _tier(root, guard)
    prompt = tokens(model.vocab_size, 3 * GRID + 5, 2)
    guard.add(GB, "spill")  # the spill spent the day's budget
    with structlog.testing.capture_logs() as logs:
        plan = head_plan(tier, prompt)
    assert plan.empty and not tier.admission.pending
    skips = [e for e in logs if e["event"] == "disk_guard_skip"]
    assert [(e["who"], e["why"]) for e in skips] == [("tier", "over")]
    assert guard.report()["skip_reasons"]["tier"] == {"over": 1}
    assert [(e["who"], e["why"], e["tokens"]) for e in guard.drain_events()] == [
        ("tier", "over", len(prompt))]
    # a plan that would write nothing anyway is no skip
    assert tier.plan(prompt[:GRID - 1], SHARED, start=0, taint=None).empty
    assert guard.report()["skips"]["tier"] == 1
    guard.add(GB // 2, "spill")
    assert head_plan(tier, prompt).empty
    assert guard.report()["skip_reasons"]["tier"] == {"over": 1, "hard": 1}
    assert not list(tier.files.entries())
    tier.check_invariants()

    clock.now = (datetime(2026, 10, 3, 12) + timedelta(days=1)).timestamp()  # a new day
    plan = head_plan(tier, prompt)
    assert not plan.empty and plan.anchor_lines
    _, _, report = write_plan(tier, model, prompt, plan)
    assert report.written and guard.report()["tier_nbytes"] == tier.index.nbytes
    assert guard.report()["skips"]["tier"] == 0  # today's skips
    tier.check_invariants()


def test_the_server_builds_its_guard_beside_the_tier_with_the_configs_budget(tmp_path):
    from tandem.config import Config, DiskConfig
    from tandem.io.tier import make_disk_tier
    from tandem.models.third import ThirdModel

    from disk_rig import engine

    config = Config(home=str(tmp_path), disk=DiskConfig(disk_cache_min_free_gb=0.0,
                                                        disk_write_budget_gb=12.5))
    tier = make_disk_tier(config, engine(ThirdModel()))
    assert tier.guard.path == tmp_path / "disk" / "writes.json"
    assert tier.guard.budget_nbytes == 12.5 * GB
    assert DiskConfig().disk_write_budget_gb == 200.0
    tier.close()
