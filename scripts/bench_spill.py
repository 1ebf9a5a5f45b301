"""The session spill's codec on rows the engine wrote, side by side in one run (issue 16).

A prefill of random tokens runs through ``tiny`` in fp32 and in bf16; its views' rows, in blocks of
``--rows-per-block`` rows a view, and its recurrent sections (an anchor) are the bytes. On the same
bytes, with the same threads:

- ``planes+zstd``: the spill's codec (tandem.io.spill_codec): byte planes, zstd frames of 8 MiB,
  a frame that does not shrink stored raw; compress includes the cut of the planes, decompress
  the join (both on the CPU here; on a GPU they run on the device);
- ``zstd``: the same frames, threads, level and raw fallback on the blocks' bytes as they are
  (one plane: no byte planes);
- ``blosc2 zstd-1``, ``zstd-5`` and ``lz4-5`` with blosc2's own byte shuffle (its clevel), where
  blosc2 is importable; else the line says it was skipped.

Every decode is checked equal to the bytes encoded. Rates are GB/s of raw bytes, best of
``--repeats``, whole (cut, frames, join) and for the frames alone (blosc2: whole); the ratio is
raw bytes over stored bytes (headers not counted). Also the block sums'
rate (tandem.kernels.blocksums) on the same rows. ``tiny``'s weights are random: its rows are not a
trained model's, so its ratios are the codec's on these rows, not the spec's box's.

The spill part (``--parts spill``), for each of fp32 and bf16: a conversation of
``--conv-tokens`` tokens prefilled through an ``Engine`` of ``tiny`` (grid anchors taken as the
prefill passes them: the rows and anchors the engine really wrote), then, in a folder under
``--dir`` (O_DIRECT where its file system takes it; the line says):

- the cold re-read: that prefill's time (what a conversation without its entry pays);
- a ``SessionSpill`` save of the conversation (its rows, the newest 4 anchors and the end);
- its restore into a fresh engine, overlapped (files k+1 to k+4 read and decompressed while file
  k is joined, summed and copied) and serial (``overlap=False``: each step in turn), best of
  ``--repeats``, checked torch.equal to the engine's rows;
- the raw read: one O_DIRECT read of a file of the entry's uncompressed bytes (rows, anchors and
  end as the engine holds them), best of ``--repeats``; the goal is a restore faster than it.

The ratios printed: prefill over save, prefill over restore, raw read over restore.

    .venv/bin/python scripts/bench_spill.py [--parts codec,spill] [--fp32-tokens 16384]
        [--bf16-tokens 16384] [--threads 2] [--levels 1,3] [--repeats 5] [--conv-tokens 32768]
        [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.cache.copies import SectionsCopy  # noqa: E402
from tandem.cache.namespace import SHARED  # noqa: E402
from tandem.config import load_config  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.io.direct import DirectFile, aligned, open_folder, round_up  # noqa: E402
from tandem.io.fingerprint import Identity  # noqa: E402
from tandem.io.spill import (ANCHORS_KEPT, EntryMeta, SessionSpill, SpillEnd,  # noqa: E402
                             session_digest)
from tandem.io.spill_codec import SpillCodec  # noqa: E402
from tandem.kernels.blocksums import view_block_sums  # noqa: E402
from tandem.kernels.planes import cut_planes  # noqa: E402
from tandem.models import load_model  # noqa: E402

GB = 1e9
PREFIX_CHUNK = 1024


def engine_blocks(dtype: str, num_tokens: int, rows_per_block: int,
                  models_dir: Path) -> tuple[list[torch.Tensor], list]:
    """The blocks of rows [0, num_tokens) of every view and the sections after them, as a
    prefill of random tokens through tiny wrote them; and the views, for the sums."""
    model = load_model("tiny", models_dir, dtype=dtype).model
    state = model.new_state(num_tokens)
    ids = torch.randint(0, model.vocab_size, (num_tokens,),
                        generator=torch.Generator().manual_seed(16))
    with torch.inference_mode():
        for a in range(0, num_tokens, PREFIX_CHUNK):
            model.forward(state, ids[a:a + PREFIX_CHUNK], a, logits=False)
    blocks = [v.rows(a, min(a + rows_per_block, num_tokens)).clone()
              for v in state.views.values() for a in range(0, num_tokens, rows_per_block)]
    blocks += [t.clone() for t in state.sections.values()]
    return blocks, list(state.views.values())


def best(repeats: int, fn: Callable[[], object]) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def raw_bytes(block: torch.Tensor) -> np.ndarray:
    return block.contiguous().reshape(-1).view(torch.uint8).numpy()


def run_codec(codec: SpillCodec, blocks, repeats: int, planes: bool):
    """(stored bytes, compress s, decompress s, frames compress s, frames decompress s) of every
    block; the frames' times leave the cut and the join out (on a GPU they run on the device).
    ``planes=False`` hands the codec each block's bytes as one uint8 plane: zstd alone on the
    same frames."""
    inputs = blocks if planes else [torch.from_numpy(raw_bytes(b)) for b in blocks]
    enc_s, encoded = best(repeats, lambda: [codec.encode(b) for b in inputs])
    host = [cut_planes(b).numpy() for b in inputs]
    frames_enc_s, _ = best(repeats, lambda: [codec.compress_planes(p, b.dtype, list(b.shape))
                                             for p, b in zip(host, inputs)])
    outs = [torch.empty_like(b) for b in inputs]
    stagings = [torch.empty(b.numel() * b.element_size(), dtype=torch.uint8) for b in inputs]
    dec_s, _ = best(repeats, lambda: [codec.decode(d, h, o, s) for (d, h), o, s
                                      in zip(encoded, outs, stagings)])
    frames_dec_s, _ = best(repeats, lambda: [codec.decompress_into(d, h, s) for (d, h), s
                                             in zip(encoded, stagings)])
    for b, o in zip(inputs, outs):
        assert torch.equal(b.view(torch.uint8), o.view(torch.uint8)), "not lossless"
    return sum(len(d) for d, _ in encoded), enc_s, dec_s, frames_enc_s, frames_dec_s


def run_blosc2(blosc2, codec_name: str, clevel: int, blocks, threads: int, repeats: int):
    codec = getattr(blosc2.Codec, codec_name)
    srcs = [raw_bytes(b) for b in blocks]

    def compress():
        return [blosc2.compress2(s, typesize=b.element_size(), clevel=clevel, codec=codec,
                                 filters=[blosc2.Filter.SHUFFLE], nthreads=threads)
                for s, b in zip(srcs, blocks)]

    enc_s, packed = best(repeats, compress)
    dsts = [bytearray(s.nbytes) for s in srcs]
    dec_s, _ = best(repeats, lambda: [blosc2.decompress2(p, dst=d, nthreads=threads)
                                      for p, d in zip(packed, dsts)])
    for s, d in zip(srcs, dsts):
        assert s.tobytes() == bytes(d), "not lossless"
    return sum(len(p) for p in packed), enc_s, dec_s, enc_s, dec_s


def codec_part(args, models_dir: Path) -> None:
    try:
        import blosc2
    except ImportError:
        blosc2 = None
    print(f"codec: threads={args.threads} frames of 8 MiB, best of "
          f"{args.repeats}; GB/s of raw bytes")
    print(f"{'rows':<6} {'tokens':>7} {'method':<24} {'raw MB':>8} {'stored MB':>10} "
          f"{'ratio':>6} {'comp GB/s':>10} {'dec GB/s':>9} {'frames comp/dec GB/s':>21}")
    prefill_threads = torch.get_num_threads()
    for dtype, num_tokens in (("float32", args.fp32_tokens), ("bfloat16", args.bf16_tokens)):
        if not num_tokens:
            continue
        t0 = time.perf_counter()
        blocks, views = engine_blocks(dtype, num_tokens, args.rows_per_block, models_dir)
        prefill_s = time.perf_counter() - t0
        raw = sum(b.numel() * b.element_size() for b in blocks)
        # The codec's threads are its parallelism; torch's own pool on a shared 2-core machine
        # waits a scheduler slice at each barrier (6 ms for a 256 KB copy, measured).
        torch.set_num_threads(1)
        results = []
        for level in args.levels:
            with SpillCodec(threads=args.threads, level=level) as codec:
                results.append((f"planes+zstd-{level} (spill)",
                                run_codec(codec, blocks, args.repeats, True)))
                results.append((f"zstd-{level} alone", run_codec(codec, blocks, args.repeats,
                                                                 False)))
        if blosc2 is not None:
            for name, clevel in (("ZSTD", 1), ("ZSTD", 5), ("LZ4", 5)):
                results.append((f"blosc2 {name.lower()}-{clevel}+shuffle", run_blosc2(
                    blosc2, name, clevel, blocks, args.threads, args.repeats)))
        for name, (stored, enc_s, dec_s, f_enc_s, f_dec_s) in results:
            print(f"{dtype[:6]:<6} {num_tokens:>7} {name:<24} {raw / 1e6:>8.2f} "
                  f"{stored / 1e6:>10.2f} {raw / stored:>6.3f} {raw / enc_s / GB:>10.3f} "
                  f"{raw / dec_s / GB:>9.3f} {raw / f_enc_s / GB:>10.3f}/{raw / f_dec_s / GB:.3f}")
        if blosc2 is None:
            print(f"{dtype[:6]:<6} {num_tokens:>7} blosc2: not installed, skipped")
        view_raw = sum(v.rows(0, num_tokens).numel() * v.tensor.element_size() for v in views)
        sums_s, _ = best(args.repeats, lambda: [view_block_sums(
            v.tensor, v.token_axis, 0, num_tokens, args.rows_per_block) for v in views])
        cut_s, _ = best(args.repeats, lambda: [cut_planes(b) for b in blocks])
        print(f"{dtype[:6]:<6} {num_tokens:>7} on {blocks[0].device}: block sums "
              f"{view_raw / sums_s / GB:.3f} GB/s, plane cut {raw / cut_s / GB:.3f} GB/s "
              f"(torch, 1 thread); prefill {prefill_s:.1f} s")
        torch.set_num_threads(prefill_threads)


def raw_read_s(folder: Path, nbytes: int, repeats: int) -> tuple[float, bool]:
    """Best time of one O_DIRECT read of a file of ``nbytes`` (written first, fsynced), and
    whether the file system took O_DIRECT."""
    fd = open_folder(folder)
    try:
        buf = aligned(round_up(nbytes))
        buf[:] = np.random.default_rng(16).integers(0, 256, buf.nbytes, dtype=np.uint8)
        with DirectFile.create(fd, "raw") as f:
            f.pwrite_from(buf, 0)
            f.finish_write()

        def read() -> bool:
            with DirectFile.open_read(fd, "raw") as f:
                assert f.pread_into(buf, 0) == buf.nbytes
                return f.direct

        return best(repeats, read)
    finally:
        os.close(fd)


def spill_part(args, models_dir: Path) -> None:
    grid = PREFIX_CHUNK
    print(f"spill: tiny, {args.conv_tokens} tokens a conversation, grid {grid}, codec threads "
          f"{args.threads}, best of {args.repeats}; folder under "
          f"{args.dir or tempfile.gettempdir()}")
    prefill_threads = torch.get_num_threads()
    for dtype in ("float32", "bfloat16"):
        model = load_model("tiny", models_dir, dtype=dtype).model
        n = args.conv_tokens
        eng = Engine(model, window=n, prefix_chunk=grid)
        ids = torch.randint(0, model.vocab_size, (n,),
                            generator=torch.Generator().manual_seed(32)).tolist()
        anchors: dict[int, SectionsCopy] = {}

        def on_chunk(end: int) -> None:
            if end % grid == 0:
                anchors[end] = SectionsCopy.take(eng.cache_state())
                while len(anchors) > ANCHORS_KEPT:
                    anchors.pop(min(anchors))

        t0 = time.perf_counter()
        with torch.inference_mode():
            eng.prefill(ids, on_chunk=on_chunk)
        prefill_s = time.perf_counter() - t0
        state = eng.cache_state()
        end = SpillEnd(n, SectionsCopy.take(state).tensors)
        meta = EntryMeta(session_digest("bench"), SHARED)
        identity = Identity("be" * 32)
        torch.set_num_threads(1)  # as in the codec part: the codec's threads are its parallelism
        with tempfile.TemporaryDirectory(prefix="bench-spill-", dir=args.dir) as scratch:
            root = Path(scratch) / "sessions"
            with SpillCodec(threads=args.threads) as codec:
                with SessionSpill(root, identity, grid, codec=codec) as spill:
                    spill.open()
                    t0 = time.perf_counter()
                    report = spill.save(meta.entry_id, state, n, ids, anchors, end, meta)
                    save_s = time.perf_counter() - t0
                fresh = Engine(model, window=n, prefix_chunk=grid)
                restore_s = {}
                for overlap in (True, False):
                    with SessionSpill(root, identity, grid, codec=codec,
                                      overlap=overlap) as spill:
                        spill.open()
                        restore_s[overlap], got = best(args.repeats, lambda: spill.restore(
                            meta.entry_id, fresh.cache_state(), []))
                    for name, v in state.views.items():
                        assert torch.equal(fresh.cache_state().views[name].rows(0, n),
                                           v.rows(0, n)), f"restored rows of {name}"
            raw = report.raw_nbytes_written
            read_s, direct = raw_read_s(Path(scratch), raw, args.repeats)
        torch.set_num_threads(prefill_threads)
        fast = restore_s[True]
        ms = ", ".join(f"{k} {v:.1f}" for k, v in report.ms.items() if k != "total")
        rms = ", ".join(f"{k} {v:.1f}" for k, v in got.ms.items() if k != "total")
        print(f"{dtype:<8} raw {raw / 1e6:.2f} MB, stored {report.nbytes_written / 1e6:.2f} MB "
              f"(ratio {raw / report.nbytes_written:.3f}), {report.blocks_written} blocks, "
              f"{report.anchors_written} anchors with the end; O_DIRECT: "
              f"{'yes' if direct else 'no (buffered, pages dropped)'}")
        print(f"{'':<8} cold re-read (Engine prefill, {prefill_threads} threads) "
              f"{prefill_s * 1000:.0f} ms")
        print(f"{'':<8} save {save_s * 1000:.1f} ms ({ms} ms)")
        print(f"{'':<8} restore overlapped {fast * 1000:.1f} ms ({raw / fast / GB:.3f} GB/s; "
              f"{rms} ms), serial {restore_s[False] * 1000:.1f} ms")
        print(f"{'':<8} raw read of the uncompressed bytes {read_s * 1000:.1f} ms "
              f"({raw / read_s / GB:.3f} GB/s)")
        print(f"{'':<8} ratios: prefill/save {prefill_s / save_s:.1f}, prefill/restore "
              f"{prefill_s / fast:.1f}, raw read/restore {read_s / fast:.3f}, serial/overlapped "
              f"restore {restore_s[False] / fast:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32-tokens", type=int, default=16384)
    ap.add_argument("--bf16-tokens", type=int, default=16384)
    ap.add_argument("--rows-per-block", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2, help="codec threads")
    ap.add_argument("--levels", type=lambda v: [int(x) for x in v.split(",")], default=[1, 3],
                    help="zstd levels, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--home", default=None, help="tandem's home (tiny is written under it)")
    ap.add_argument("--parts", type=lambda v: v.split(","), default=["codec", "spill"],
                    help="codec, spill or both, comma-separated")
    ap.add_argument("--conv-tokens", type=int, default=32768,
                    help="the spill part's conversation, in tokens")
    ap.add_argument("--dir", default=None,
                    help="the spill part's folder goes under it (default: the temp dir)")
    args = ap.parse_args()
    config = load_config(cli_args={"home": args.home} if args.home else None)
    if "codec" in args.parts:
        codec_part(args, config.models_dir())
    if "spill" in args.parts:
        spill_part(args, config.models_dir())


if __name__ == "__main__":
    main()
