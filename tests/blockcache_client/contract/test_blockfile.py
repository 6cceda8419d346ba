"""Block file format: seal/unseal round trip, tamper detection, partial decrypt."""

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockcache_client.contract import blockfile
from blockcache_client.contract.blockfile import (
    HEADER_SIZE,
    MIN_CHUNK,
    TAG_SIZE,
    BlockCipher,
    BlockHeader,
    key_id,
    seal,
    unseal,
)
from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.contract.errors import FormatError, IntegrityError

VK = bytes(range(32))
OTHER_VK = bytes(range(1, 33))
KEY = str(BlockKey("vol", 42, 0xDEADBEEF, 0))
KEY2 = str(BlockKey("vol", 42, 0xDEADBEEF, 4 << 20))


def data_of(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


chunk_sizes = st.sampled_from([MIN_CHUNK, 8 << 10, 64 << 10])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200_000), chunk=chunk_sizes, seed=st.integers(0, 2**32),
       offset=st.integers(0, 210_000), length=st.integers(0, 210_000) | st.none())
def test_round_trip_random_ranges(n, chunk, seed, offset, length):
    plain = data_of(n, seed)
    blob = seal(KEY, plain, VK, chunk)
    header = BlockHeader.parse(blob)
    header.check_file_size(len(blob))
    assert header.plaintext_len == n and header.chunk_size == chunk
    end = None if length is None else offset + length
    assert unseal(KEY, blob, VK, offset, length) == plain[offset:end]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200_000), chunk=chunk_sizes, seed=st.integers(0, 2**32),
       offset=st.integers(0, 200_000), length=st.integers(0, 210_000))
def test_read_range_into_equals_read_range(n, chunk, seed, offset, length):
    plain = data_of(n, seed)
    blob = seal(KEY, plain, VK, chunk)
    c = BlockCipher(BlockHeader.parse(blob), KEY, VK)
    offset = min(offset, n)
    length = min(length, n - offset)
    start, stop = c.header.ciphertext_range(*c.header.chunk_span(offset, length))
    out = bytearray(b"\xee" * (length + 3))  # bytes past the range stay untouched
    c.read_range_into(offset, memoryview(blob)[start:stop], memoryview(out)[:length])
    assert bytes(out[:length]) == plain[offset:offset + length] == \
        c.read_range(offset, length, blob[start:stop])
    assert out[length:] == b"\xee" * 3


def test_read_range_into_tampered_leaves_no_plaintext():
    plain = data_of(5 * MIN_CHUNK)
    blob = bytearray(seal(KEY, plain, VK, MIN_CHUNK))
    blob[-5] ^= 1  # the last chunk's tag: the chunks before it decrypt fine first
    c = BlockCipher(BlockHeader.parse(blob), KEY, VK)
    out = bytearray(len(plain))
    with pytest.raises(IntegrityError):
        c.read_range_into(0, memoryview(blob)[HEADER_SIZE:], memoryview(out))
    assert out == bytes(len(plain))


def test_whole_block_and_empty():
    plain = data_of(300_000)
    assert unseal(KEY, seal(KEY, plain, VK), VK) == plain
    assert unseal(KEY, seal(KEY, b"", VK), VK) == b""


def test_fresh_salt_every_seal():
    a, b = seal(KEY, b"x" * 100, VK), seal(KEY, b"x" * 100, VK)
    assert a[16:32] != b[16:32] and a[HEADER_SIZE:] != b[HEADER_SIZE:]


def assert_rejected(key, blob, vk=VK, offset=0, length=None):
    with pytest.raises(IntegrityError):
        unseal(key, blob, vk, offset, length)


SIZES = [0, 1, MIN_CHUNK, 3 * MIN_CHUNK + 17]


@pytest.mark.parametrize("n", SIZES)
def test_wrong_volume_key(n):
    assert_rejected(KEY, seal(KEY, data_of(n), VK, MIN_CHUNK), OTHER_VK)


@pytest.mark.parametrize("n", SIZES)
def test_renamed_to_another_key(n):
    blob = seal(KEY, data_of(n), VK, MIN_CHUNK)
    assert_rejected(KEY2, blob)
    assert_rejected(str(BlockKey("vol2", 42, 0xDEADBEEF, 0)), blob)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 5 * MIN_CHUNK), cut=st.integers(1, 6 * MIN_CHUNK))
def test_truncated(n, cut):
    blob = seal(KEY, data_of(n), VK, MIN_CHUNK)
    assert_rejected(KEY, blob[:max(0, len(blob) - cut)])


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 5 * MIN_CHUNK), extra=st.binary(min_size=1, max_size=MIN_CHUNK + 40))
def test_extended(n, extra):
    blob = seal(KEY, data_of(n), VK, MIN_CHUNK)
    assert_rejected(KEY, blob + extra)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 4 * MIN_CHUNK), data=st.data())
def test_flipped_bit_anywhere(n, data):
    blob = bytearray(seal(KEY, data_of(n), VK, MIN_CHUNK))
    pos = data.draw(st.integers(0, len(blob) - 1))
    blob[pos] ^= 1 << data.draw(st.integers(0, 7))
    assert_rejected(KEY, bytes(blob))


def test_flipped_bit_in_touched_chunk_with_partial_read():
    n = 4 * MIN_CHUNK
    blob = bytearray(seal(KEY, data_of(n), VK, MIN_CHUNK))
    step = MIN_CHUNK + TAG_SIZE
    blob[HEADER_SIZE + 2 * step + 5] ^= 0x80
    assert_rejected(KEY, bytes(blob), offset=2 * MIN_CHUNK + 1, length=10)
    # untouched chunks still decrypt: a partial read authenticates what it returns
    assert unseal(KEY, bytes(blob), VK, 0, 10) == data_of(n)[:10]


def chunks_of(blob):
    step = MIN_CHUNK + TAG_SIZE
    body = blob[HEADER_SIZE:]
    return blob[:HEADER_SIZE], [body[i:i + step] for i in range(0, len(body), step)]


def test_chunks_reordered():
    blob = seal(KEY, data_of(4 * MIN_CHUNK), VK, MIN_CHUNK)
    head, chunks = chunks_of(blob)
    chunks[1], chunks[2] = chunks[2], chunks[1]
    swapped = head + b"".join(chunks)
    assert_rejected(KEY, swapped)
    assert_rejected(KEY, swapped, offset=MIN_CHUNK, length=1)


def test_last_chunk_moved_earlier_with_equal_sizes():
    # every chunk full: only the last-chunk flag tells the last one apart
    blob = seal(KEY, data_of(3 * MIN_CHUNK), VK, MIN_CHUNK)
    head, chunks = chunks_of(blob)
    assert_rejected(KEY, head + chunks[2] + chunks[1] + chunks[0])


def test_chunk_swapped_between_blocks():
    a = seal(KEY, data_of(3 * MIN_CHUNK, 1), VK, MIN_CHUNK)
    b = seal(KEY, data_of(3 * MIN_CHUNK, 2), VK, MIN_CHUNK)  # same key, other salt
    ha, ca = chunks_of(a)
    hb, cb = chunks_of(b)
    mixed = ha + ca[0] + cb[1] + ca[2]
    assert_rejected(KEY, mixed)
    assert_rejected(KEY, mixed, offset=MIN_CHUNK, length=1)
    # b's header on a's chunks
    assert_rejected(KEY, hb + b"".join(ca))


def test_zero_filled_right_length():
    blob = seal(KEY, data_of(5000), VK, MIN_CHUNK)
    assert_rejected(KEY, bytes(len(blob)))


def test_header_parse_without_key():
    blob = seal(KEY, data_of(5000), VK, MIN_CHUNK)
    h = BlockHeader.parse(blob)
    assert h.key_id == key_id(VK) and h.plaintext_len == 5000
    assert h.file_size == len(blob)
    with pytest.raises(FormatError):
        h.check_file_size(len(blob) - 1)
    for bad in (b"", blob[:HEADER_SIZE - 1], b"XXXX" + blob[4:], blob[:4] + b"\x02" + blob[5:],
                blob[:5] + b"\x09" + blob[6:], blob[:6] + b"\x00\x01" + blob[8:],
                blob[:44] + b"\x00\x00\x00\x01" + blob[48:]):
        with pytest.raises(FormatError):
            BlockHeader.parse(bad)


@pytest.mark.parametrize("chunk", [0, 1000, MIN_CHUNK // 2, 3 * MIN_CHUNK, 2 << 20])
def test_bad_chunk_size(chunk):
    with pytest.raises((ValueError, FormatError)):
        seal(KEY, b"abc", VK, chunk)


def test_oversized_block_refused():
    with pytest.raises(ValueError):
        seal(KEY, bytes(blockfile.MAX_PLAINTEXT + 1), VK)


def test_bad_volume_key_type():
    with pytest.raises(ValueError):
        seal(KEY, b"x", b"short")


class CountingAESGCM:
    """Wraps AESGCM to count the ciphertext bytes it is asked to decrypt."""

    decrypted = 0

    def __init__(self, key):
        self._real = blockfile.AESGCM.__wrapped_real__(key)

    def encrypt_into(self, nonce, data, aad, buf):
        return self._real.encrypt_into(nonce, data, aad, buf)

    def decrypt(self, nonce, data, aad):
        CountingAESGCM.decrypted += len(data)
        return self._real.decrypt(nonce, data, aad)

    def decrypt_into(self, nonce, data, aad, buf):
        CountingAESGCM.decrypted += len(data)
        return self._real.decrypt_into(nonce, data, aad, buf)


@pytest.fixture
def counting(monkeypatch):
    real = blockfile.AESGCM
    monkeypatch.setattr(CountingAESGCM, "decrypted", 0)
    monkeypatch.setattr(blockfile, "AESGCM", type("AESGCM", (CountingAESGCM,),
                                                  {"__wrapped_real__": real}))
    return CountingAESGCM


def test_4k_read_of_4m_block_decrypts_one_chunk(counting):
    plain = os.urandom(4 << 20)
    blob = seal(KEY, plain, VK)
    counting.decrypted = 0
    rng = random.Random(7)
    for _ in range(20):
        off = rng.randrange(0, (4 << 20) - 4096)
        off -= off % 4096  # aligned 4 KiB reads never straddle a 64 KiB chunk
        before = counting.decrypted
        assert unseal(KEY, blob, VK, off, 4096) == plain[off:off + 4096]
        assert counting.decrypted - before == blockfile.DEFAULT_CHUNK + TAG_SIZE


def test_block_cipher_reads_only_given_chunks(counting):
    plain = data_of(10 * MIN_CHUNK)
    blob = seal(KEY, plain, VK, MIN_CHUNK)
    h = BlockHeader.parse(blob)
    c = BlockCipher(h, KEY, VK)
    first, end = h.chunk_span(3 * MIN_CHUNK + 100, MIN_CHUNK)
    assert (first, end) == (3, 5)
    start, stop = h.ciphertext_range(first, end)
    counting.decrypted = 0
    assert c.read_range(3 * MIN_CHUNK + 100, MIN_CHUNK, blob[start:stop]) == \
        plain[3 * MIN_CHUNK + 100:4 * MIN_CHUNK + 100]
    assert counting.decrypted == 2 * (MIN_CHUNK + TAG_SIZE)
    with pytest.raises(IntegrityError):
        c.open_chunks(first, end, blob[start:stop - 1])


def test_seal_into_reuses_its_buffer_and_matches_seal_format():
    """A fill thread seals into one buffer: each result unseals to its own
    plaintext, a short buffer grows, and the returned cipher reads the block."""
    buf = None
    for n, grows in ((5000, True), (3 * MIN_CHUNK + 7, True), (10, False), (0, False)):
        plain = data_of(n)
        view, cipher = blockfile.seal_into(KEY, plain, VK, MIN_CHUNK, buf)
        assert len(view) == HEADER_SIZE + n + max(1, -(-n // MIN_CHUNK)) * TAG_SIZE
        assert (view.obj is not buf) == grows  # written in place unless too short
        buf = view.obj
        assert unseal(KEY, view.tobytes(), VK) == plain
        assert cipher.read_range(0, n, view[HEADER_SIZE:]) == plain


@pytest.mark.parametrize("ikm,salt,info,okm", [
    # RFC 5869, A.1-A.3 (SHA-256): each OKM's first 32 bytes are what we derive
    ("0b" * 22, "000102030405060708090a0b0c", "f0f1f2f3f4f5f6f7f8f9",
     "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"),
    (bytes(range(0x00, 0x50)).hex(), bytes(range(0x60, 0xb0)).hex(),
     bytes(range(0xb0, 0x100)).hex(),
     "b11e398dc80327a1c8e7f78c596a49344f012eda2d4efad8a050cc4c19afa97c"),
    ("0b" * 22, "", "", "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"),
])
def test_hkdf_matches_rfc5869_known_answers(ikm, salt, info, okm):
    assert blockfile.hkdf_sha256(bytes.fromhex(ikm), bytes.fromhex(salt),
                                 bytes.fromhex(info)) == bytes.fromhex(okm)
