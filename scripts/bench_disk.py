"""The disk tier's rates on a random checkpoint whose rows weigh what a real model's do (tens of
KiB a token: 8 attention layers of 8 KV heads of 64, float32, 32 KiB a token), in one run:

- TTFT, cold: a new session's first turn, a head of ``--chunks`` grid steps and a ``--tail`` of
  its own, prefilled whole by ``tandem.engine.Engine`` (its rows and its anchor are what the
  tier then writes);
- write: ``DiskTier.write_entries`` of the head's chunks and its anchor (tmp, fsync, rename, the
  folder's fsync; crc32 of every section), GB/s of file bytes;
- restore: ``DiskTier.offer`` + ``restore`` through a reopened tier into a second state (every
  file's header, token ids and crc32 checked, the rows copied into the views), against a raw
  O_DIRECT read of the same files' bytes in the same run, the two taking turns (the goal: 0.9
  or more). The tier and the raw read each keep their buffers across the turns, as a server's
  tier does; the first restore after the reopen (its buffers' pages faulted in) is shown apart.
  Beside it, the raw read into two buffers taken in turn, the fewest a restore that reads one
  file while it checks the one before can land its reads in (on a VM, slower than one);
- TTFT, disk: the same first turn in a fresh engine through the reopened tier: the restore, then
  the prefill of the tail, its logits checked equal to the cold prefill's bit for bit;
- crc32: the tier's crc32 (zlib-ng's) and the stdlib's over one chunk's bytes.

The files go to a folder of their own under ``--dir`` (the real disk: tmpfs refuses O_DIRECT and
its rates mean nothing), deleted after. The restore is checked equal to what was written.

    .venv/bin/python scripts/bench_disk.py [--chunks 8] [--grid 1024] [--tail 256]
                                           [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tandem.cache.copies import SectionsCopy
from tandem.cache.namespace import SHARED
from tandem.engine import Engine, argmax
from tandem.io.admission import Admission, DiskPlan
from tandem.io.chain import chain_keys
from tandem.io.direct import DirectFile, aligned, open_folder
from tandem.io.fingerprint import Identity
from tandem.io.tier import DiskTier, host_rows
from tandem.io.tierfile import crc32 as tier_crc32
from tandem.models.base import CacheState
from tandem.models.hybrid import HybridModel
from tandem.models.tiny import TINY_CONFIG, _weights

GB = 10 ** 9
KiB = 1 << 10

CONFIG = dict(
    TINY_CONFIG, vocab_size=4096, hidden_size=128, intermediate_size=256,
    num_hidden_layers=16, layer_types=["linear_attention", "full_attention"] * 8,
    num_attention_heads=8, num_key_value_heads=8, head_dim=64)


def random_checkpoint(folder: Path) -> HybridModel:
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file(_weights(CONFIG), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return HybridModel.load(folder)


def raw_read(tier: DiskTier, entries: list[tuple[str, str]], *bufs: np.ndarray) -> float:
    """Seconds to read the files' bytes with O_DIRECT into aligned buffers taken in turn,
    nothing checked."""
    sizes = [tier.files.path(kind, key).stat().st_size for kind, key in entries]
    t0 = time.perf_counter()
    for i, ((kind, key), size) in enumerate(zip(entries, sizes)):
        folder = open_folder(key[:2], dir_fd=tier.files.root_fd, create=False)
        try:
            with DirectFile.open_read(folder, tier.files.file_name(kind, key)) as f:
                assert f.pread_into(bufs[i % len(bufs)][:size], 0) == size
        finally:
            os.close(folder)
    return time.perf_counter() - t0


def crc_rate(crc, data: bytes, repeats: int) -> float:
    crc(data)
    t0 = time.perf_counter()
    for _ in range(repeats):
        crc(data)
    return len(data) * repeats / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--grid", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=256, help="the new session's own tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-disk-", dir=args.dir))
    try:
        model = random_checkpoint(work)
        g, n = args.grid, args.chunks * args.grid
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, CONFIG["vocab_size"], (n + args.tail,), generator=gen).tolist()
        window = len(prompt) + g

        # the first turn, cold: its rows and the sections at the head's line are the files
        cold = Engine(model, window=window, prefix_chunk=g)
        staged: dict[int, SectionsCopy] = {}

        def on_chunk(end: int) -> None:
            if end == n:
                staged[n] = SectionsCopy.take(cold.cache_state())

        t0 = time.perf_counter()
        want = cold.prefill(prompt, on_chunk=on_chunk)
        first_token = argmax(want)
        ttft_cold_s = time.perf_counter() - t0
        written = cold.cache_state()
        row_nbytes = written.row_nbytes()
        keys = tuple(chain_keys(prompt, g, SHARED)[:args.chunks])
        plan = DiskPlan(g, (n,), tuple(range(g, n + 1, g)), keys, (("repeated",),))
        root = work / "disk"

        def open_tier() -> DiskTier:
            admission = Admission(None, grid=g)
            return DiskTier(root, Identity("0f" * 32), g, admission=admission,
                            budget_nbytes=1 << 50, floor_nbytes=0)

        tier = open_tier()
        rows = {line: host_rows(written.views, line - g, line) for line in plan.chunk_lines}
        tier.admission.pending.update(plan.entries())
        t0 = time.perf_counter()
        report = tier.write_entries(plan, prompt, staged, rows)
        write_s = time.perf_counter() - t0
        assert not report.failed and not report.dropped, report
        file_nbytes = report.nbytes
        transfers = dict(tier.files.transfers)
        tier.close()

        tier = open_tier()  # a restart: the files are the index
        target = model.new_state(window)
        entries = [("anchor", keys[-1])] + [("chunk", k) for k in keys]
        largest = max(tier.files.path(kind, key).stat().st_size for kind, key in entries)
        buf, other = aligned(largest), aligned(largest)
        raws, raws2, restores = [], [], []
        for _ in range(args.repeats + 1):  # they take turns: the disk's state is shared
            raws.append(raw_read(tier, entries, buf))
            raws2.append(raw_read(tier, entries, buf, other))
            offer = tier.offer(prompt, SHARED, start=0)
            assert offer is not None and offer.line == n
            t0 = time.perf_counter()
            tier.restore(offer, prompt, _state(target))
            restores.append(time.perf_counter() - t0)
        for name, v in written.views.items():
            assert torch.equal(target.views[name].rows(0, n), v.rows(0, n)), name
        for name, t in staged[n].tensors.items():
            assert torch.equal(target.sections[name], t), name
        del target

        # the first turn from the disk: a fresh engine, the restore, the tail's prefill
        eng = Engine(model, window=window, prefix_chunk=g)
        ttfts, ttft_restores = [], []
        for _ in range(args.repeats):
            eng.reset()
            t0 = time.perf_counter()
            offer = tier.offer(prompt, SHARED, start=0)
            assert offer is not None and offer.line == n
            tier.restore(offer, prompt, eng.cache_state())
            eng.resume_at(offer.line, prompt, taint=None)
            ttft_restores.append(time.perf_counter() - t0)
            got = eng.prefill(prompt)
            token = argmax(got)
            ttfts.append(time.perf_counter() - t0)
            assert torch.equal(got, want) and token == first_token
        transfers.update({k: v for k, v in tier.files.transfers.items() if k.startswith("read")})
        tier.close()

        chunk = rows[g]
        crc_buf = torch.cat([t.reshape(-1).view(torch.uint8) for t in chunk.tensors.values()])
        crc_bytes = crc_buf.numpy().tobytes()

        raw_s, restore_s = statistics.median(raws[1:]), statistics.median(restores[1:])
        raw2_s = statistics.median(raws2[1:])
        ttft_disk_s = statistics.median(ttfts)
        print(json.dumps({
            "row_kib_per_token": row_nbytes / KiB,
            "grid": g, "chunks": args.chunks, "tail": args.tail, "file_gb": file_nbytes / GB,
            "write_gb_s": file_nbytes / write_s / GB,
            "raw_read_gb_s": file_nbytes / raw_s / GB,
            "restore_gb_s": file_nbytes / restore_s / GB,
            "restore_over_raw": raw_s / restore_s,
            "restore_ms": restore_s * 1000.0, "raw_ms": raw_s * 1000.0,
            "restore_over_raw_two_buffers": raw2_s / restore_s,
            "raw_two_buffers_over_raw": raw_s / raw2_s,
            "restore_over_raw_each": [round(r / t, 3) for r, t in zip(raws, restores)],
            "first_restore_ms": restores[0] * 1000.0, "first_raw_ms": raws[0] * 1000.0,
            "crc32_gb_s": crc_rate(tier_crc32, crc_bytes, args.repeats) / GB,
            "zlib_crc32_gb_s": crc_rate(zlib.crc32, crc_bytes, args.repeats) / GB,
            "ttft_cold_ms": ttft_cold_s * 1000.0,
            "ttft_disk_ms": ttft_disk_s * 1000.0,
            "ttft_disk_each_ms": [round(t * 1000.0, 1) for t in ttfts],
            "ttft_disk_restore_ms": statistics.median(ttft_restores) * 1000.0,
            "ttft_cold_over_disk": ttft_cold_s / ttft_disk_s,
            "transfers": transfers,
        }, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _state(model_state) -> CacheState:
    return CacheState(sections=model_state.sections, views=model_state.views)


if __name__ == "__main__":
    main()
