"""The spill's block codec (tandem.io.spill_codec, tandem.kernels.planes; issue 16, part 5): byte
planes round trip bit for bit, a compressed block and a raw one decode to the same tensor
(torch.equal: the codec is lossless, so the gate is bit for bit), frames that do not shrink are
stored raw, a bad block is refused typed, and a block of the older codec reads as written."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tandem.io.spill_codec import (CODEC_VERSION, PLANES_ZSTD, RAW, BlockHeader, CodecError,
                                   Frame, SpillCodec, decode_block, encode_block)
from tandem.kernels.blocksums import block_sums
from tandem.kernels.planes import (cut_planes, cut_planes_reference, join_planes,
                                   join_planes_reference)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kv_like(shape, dtype, seed=0):
    """Rows with a KV cache's statistics: normal values (a few exponents, random mantissas)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:  # e4m3 codes: clustered, as an fp8 cache's are
        return (torch.randn(shape, generator=gen) * 12 + 100).clamp(0, 255).to(torch.uint8)
    return torch.randn(shape, generator=gen).to(dtype)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    """An out buffer no decode has written: NaN (255 for integers), so that a byte left
    unwritten fails torch.equal."""
    out = torch.empty_like(like)
    return out.fill_(255 if not like.is_floating_point() else float("nan"))


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(DTYPES + [torch.int64, torch.float64]),
       st.lists(st.integers(0, 7), min_size=1, max_size=3), st.integers(0, 2 ** 31))
def test_byte_planes_round_trip_bit_for_bit_and_match_the_numpy_reference(dtype, shape, seed):
    t = kv_like(shape, torch.float32, seed).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 255, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    planes = cut_planes(t)
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert np.array_equal(planes.numpy(), cut_planes_reference(raw, t.element_size()))
    assert join_planes_reference(planes.numpy()) == raw
    out = poisoned(t)
    assert torch.equal(join_planes(planes, out).view(torch.uint8), t.view(torch.uint8))


def test_the_first_plane_holds_every_elements_low_byte():
    t = torch.tensor([0x0102, 0x0304, 0x0506], dtype=torch.int16)
    assert cut_planes(t).tolist() == [[0x02, 0x04, 0x06], [0x01, 0x03, 0x05]]


@pytest.mark.parametrize("device", DEVICES)
def test_planes_are_cut_and_joined_where_the_rows_are_from_a_non_contiguous_view(device):
    t = kv_like((2, 1, 64, 16), torch.bfloat16, 3).to(device)[:, :, 8:40]
    planes = cut_planes(t)
    assert planes.device == t.device and planes.shape == (2, t.numel())
    out = poisoned(torch.empty(2, 1, 32, 32, dtype=torch.bfloat16, device=device))[..., ::2]
    assert not out.is_contiguous()
    join_planes(planes.cpu(), out)
    assert out.device == t.device and torch.equal(out, t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_compressed_block_and_a_raw_one_decode_to_the_same_tensor(dtype, device):
    block = kv_like((2, 1, 300, 32), dtype, 5).to(device)[:, :, 20:280]  # not contiguous
    with SpillCodec(threads=2, frame_nbytes=4096) as codec:
        packed, header = codec.encode(block)
        raw, raw_header = codec.encode(block, version=RAW)
        assert header.version == CODEC_VERSION == PLANES_ZSTD and raw_header.version == RAW
        assert len(raw) == block.numel() * block.element_size()
        assert len(packed) == header.nbytes < len(raw)
        a = codec.decode(packed, header, poisoned(block))
        b = codec.decode(raw, raw_header, poisoned(block))
    assert a.device == block.device
    assert torch.equal(a, block) and torch.equal(b, block)


def test_the_low_byte_of_bf16_is_stored_raw_and_its_high_byte_compressed():
    block = kv_like((4, 1, 1024, 64), torch.bfloat16, 7)
    data, header = encode_block(block)
    low = [f for f in header.frames if f.plane == 0]
    high = [f for f in header.frames if f.plane == 1]
    assert low and all(f.stored_raw for f in low)
    assert high and not any(f.stored_raw for f in high)
    assert sum(f.nbytes for f in high) < sum(f.raw_nbytes for f in high) / 2
    assert torch.equal(decode_block(data, header, poisoned(block)), block)


def test_a_mixed_block_of_raw_and_compressed_frames_decodes_bit_for_bit():
    # fp32 of N(0, 1): the top plane (sign, exponent) shrinks, the mantissa planes do not; small
    # frames make each plane several frames, some raw, some not.
    block = kv_like((3, 1, 700, 24), torch.float32, 11)
    with SpillCodec(threads=3, frame_nbytes=3000) as codec:
        data, header = codec.encode(block)
        kinds = {f.stored_raw for f in header.frames}
        assert kinds == {True, False}
        assert max(f.raw_nbytes for f in header.frames) == 3000
        assert [f.plane for f in header.frames] == sorted(f.plane for f in header.frames)
        assert torch.equal(codec.decode(data, header, poisoned(block)), block)


def test_the_frames_are_the_same_bytes_on_one_thread_and_on_many():
    block = kv_like((2, 1, 512, 32), torch.bfloat16, 13)
    with SpillCodec(threads=1, frame_nbytes=2048) as one, \
            SpillCodec(threads=4, frame_nbytes=2048) as many:
        a, b = one.encode(block), many.encode(block)
        assert bytes(a.data) == bytes(b.data) and a.header == b.header
        assert torch.equal(one.decode(b.data, b.header, poisoned(block)), block)


def test_an_all_zero_block_compresses_to_almost_nothing_and_an_empty_block_to_nothing():
    zeros = torch.zeros(64, 1024, dtype=torch.bfloat16)
    data, header = encode_block(zeros)
    assert len(data) < zeros.numel() * 2 / 100
    assert torch.equal(decode_block(data, header, poisoned(zeros)), zeros)
    empty = torch.empty(0, 8, dtype=torch.float32)
    data, header = encode_block(empty)
    assert len(data) == 0 and header.frames == []
    assert decode_block(data, header, torch.empty(0, 8)).shape == (0, 8)


def test_a_block_of_the_older_codec_reads_as_written():
    """An entry's unchanged blocks keep the codec they were written with (a rewrite does not
    recompress them), so a reader decodes each block by its header's version."""
    block = kv_like((2, 1, 128, 16), torch.float16, 17)
    old_data, old_header = encode_block(block, version=RAW)
    stored = (bytes(old_data), old_header.to_bytes())  # as a file keeps them
    header = BlockHeader.from_bytes(stored[1])
    assert header.version == RAW and header.frames == []
    assert bytes(stored[0]) == block.contiguous().view(torch.uint8).numpy().tobytes()
    assert torch.equal(decode_block(stored[0], header, poisoned(block)), block)


def test_a_header_round_trips_through_its_bytes():
    block = kv_like((2, 300), torch.bfloat16, 19)
    _, header = encode_block(block)
    assert BlockHeader.from_bytes(header.to_bytes()) == header
    assert header.raw_nbytes == 1200 and header.element_size == 2 and header.numel == 600


def test_encode_writes_into_a_callers_buffer_and_decode_through_a_callers_staging():
    block = kv_like((2, 1, 256, 32), torch.bfloat16, 23)
    out = memoryview(bytearray(1 << 16))
    with SpillCodec(threads=2, frame_nbytes=4096) as codec:
        data, header = codec.encode(block, out=out)
        assert data.obj is out.obj and len(data) == header.nbytes
        staging = torch.full((1 << 16,), 7, dtype=torch.uint8)
        planes = codec.decompress_into(data, header, staging)
        assert planes.data_ptr() == staging.data_ptr() and planes.shape == (2, block.numel())
        assert torch.equal(codec.join_into(planes, header, poisoned(block)), block)
        with pytest.raises(ValueError):
            codec.decompress_into(data, header, torch.empty(10, dtype=torch.uint8))


def compressed_frame_at(header: BlockHeader) -> int:
    at = 0
    for f in header.frames:
        if not f.stored_raw:
            return at
        at += f.nbytes
    raise AssertionError("no compressed frame")


@pytest.mark.parametrize("where", ["the frame's start", "its middle", "its checksum"])
def test_a_corrupted_frame_raises_a_typed_error(where):
    block = kv_like((2, 1, 512, 32), torch.bfloat16, 29)
    data, header = encode_block(block)
    first = compressed_frame_at(header)
    frame = next(f for f in header.frames if not f.stored_raw)
    at = {"the frame's start": first + 1, "its middle": first + frame.nbytes // 2,
          "its checksum": first + frame.nbytes - 1}[where]
    bad = bytearray(data)
    bad[at] ^= 0x10
    with pytest.raises(CodecError) as e:
        decode_block(bad, header, poisoned(block))
    assert e.value.reason == "frame"


def test_a_truncated_block_and_a_lying_header_are_refused_typed():
    block = kv_like((2, 1, 256, 32), torch.float16, 31)
    codec = SpillCodec(threads=1, frame_nbytes=4096)
    data, header = codec.encode(block)
    out = poisoned(block)
    with pytest.raises(CodecError) as e:
        codec.decode(data[:-1], header, out)
    assert e.value.reason == "length"
    frames = list(header.frames)
    i = next(i for i, f in enumerate(frames) if not f.stored_raw and frames[i + 1].plane == f.plane)
    f, g = frames[i], frames[i + 1]
    # a compressed frame claiming one byte more than it decodes to, the next one of its plane
    # one less: the planes still add up, the frame does not
    frames[i] = Frame(f.plane, f.raw_nbytes + 1, f.nbytes, f.stored_raw)
    frames[i + 1] = Frame(g.plane, g.raw_nbytes - 1, g.nbytes - g.stored_raw, g.stored_raw)
    lying = BlockHeader(header.version, header.dtype, header.shape, frames)
    lying.check()
    with pytest.raises(CodecError) as e:
        codec.decode(data[:lying.nbytes], lying, out)
    assert e.value.reason == "frame"
    with pytest.raises(CodecError) as e:
        decode_block(data, BlockHeader(header.version, header.dtype, header.shape,
                                       header.frames[1:]), out)
    assert e.value.reason == "header"
    with pytest.raises(CodecError) as e:
        decode_block(data, header, torch.empty(block.shape, dtype=torch.float32))
    assert e.value.reason == "header"


def test_a_header_of_an_unknown_codec_or_not_a_header_at_all_is_refused_typed():
    _, header = encode_block(kv_like((4, 4), torch.float32))
    future = BlockHeader(99, header.dtype, header.shape, header.frames).to_bytes()
    with pytest.raises(CodecError) as e:
        BlockHeader.from_bytes(future)
    assert e.value.reason == "version"
    with pytest.raises(CodecError) as e:
        BlockHeader.from_bytes(b"\x93not a header")
    assert e.value.reason == "header"
    with pytest.raises(CodecError) as e:
        BlockHeader.from_bytes(BlockHeader(PLANES_ZSTD, "complex128", [2], []).to_bytes())
    assert e.value.reason == "header"


def test_a_flipped_byte_in_a_raw_frame_decodes_and_the_sums_refuse_it():
    """The codec checks structure, not the bytes of a raw frame: the spill sums every block it
    joins back, and that is what catches it."""
    block = kv_like((2, 1, 512, 32), torch.bfloat16, 37)
    want = block_sums(block)
    data, header = encode_block(block)
    assert header.frames[0].stored_raw
    bad = bytearray(data)
    bad[5] ^= 0x01
    back = decode_block(bad, header, poisoned(block))
    assert not torch.equal(block_sums(back), want)
    assert torch.equal(block_sums(decode_block(data, header, poisoned(block))), want)


def test_rows_and_sections_the_engine_wrote_round_trip_bit_for_bit(hybrid):
    state = hybrid.new_state(1024)
    ids = torch.randint(0, hybrid.vocab_size, (700,), generator=torch.Generator().manual_seed(41))
    hybrid.forward(state, ids, 0, logits=False)
    with SpillCodec(threads=2, frame_nbytes=1 << 14) as codec:
        for name, view in state.views.items():
            for a in range(0, 700, 256):
                block = view.rows(a, min(a + 256, 700))
                data, header = codec.encode(block)
                assert torch.equal(codec.decode(data, header, poisoned(block)), block), name
        for name, t in state.sections.items():
            data, header = codec.encode(t)
            assert torch.equal(codec.decode(data, header, poisoned(t)), t), name


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(0, 3000), st.integers(1, 5000),
       st.sampled_from([1, 3]), st.booleans())
def test_any_block_round_trips_through_any_frame_size(dtype, numel, frame_nbytes, threads,
                                                      compressible):
    block = kv_like((numel,), dtype, numel) if compressible else \
        torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                      generator=torch.Generator().manual_seed(numel),
                      dtype=torch.uint8).view(dtype)
    with SpillCodec(threads=threads, frame_nbytes=frame_nbytes) as codec:
        data, header = codec.encode(block)
        assert all(f.raw_nbytes <= frame_nbytes for f in header.frames)
        header = BlockHeader.from_bytes(header.to_bytes())
        out = codec.decode(bytes(data), header, poisoned(block))
    assert torch.equal(out.view(torch.uint8), block.view(torch.uint8))
