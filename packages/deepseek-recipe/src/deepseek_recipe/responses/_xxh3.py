"""XXH3-64 (seed 0, default secret) in pure Python, for the tool-call id checksum.

Written from the published XXH3 algorithm description (Yann Collet's xxHash).
Tool-call ids hash 26–30 bytes, i.e. the 17–128 byte path, which only reads
the first 32 bytes of the secret; the other length classes are implemented for
completeness.
"""

from __future__ import annotations

__all__ = ["xxh3_64"]

_M = (1 << 64) - 1
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5

_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)


def _r64(b: bytes, i: int) -> int:
    return int.from_bytes(b[i : i + 8], "little")


def _r32(b: bytes, i: int) -> int:
    return int.from_bytes(b[i : i + 4], "little")


def _fold(a: int, b: int) -> int:
    p = a * b
    return (p ^ (p >> 64)) & _M


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & _M
    return h ^ (h >> 32)


def _xxh64_avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * P64_2) & _M
    h ^= h >> 29
    h = (h * P64_3) & _M
    return h ^ (h >> 32)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M


def _mix16(data: bytes, i: int, s: int) -> int:
    return _fold(_r64(data, i) ^ _r64(_SECRET, s), _r64(data, i + 8) ^ _r64(_SECRET, s + 8))


def _long(data: bytes) -> int:
    n = len(data)
    acc = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1]
    secret_size = len(_SECRET)
    stripes_per_block = (secret_size - 64) // 8
    block_len = 64 * stripes_per_block

    def accumulate(offset: int, s: int) -> None:
        for k in range(8):
            v = _r64(data, offset + 8 * k)
            key = v ^ _r64(_SECRET, s + 8 * k)
            acc[k ^ 1] = (acc[k ^ 1] + v) & _M
            acc[k] = (acc[k] + (key & 0xFFFFFFFF) * (key >> 32)) & _M

    def scramble() -> None:
        s = secret_size - 64
        for k in range(8):
            a = acc[k]
            a ^= a >> 47
            a ^= _r64(_SECRET, s + 8 * k)
            acc[k] = (a * P32_1) & _M

    blocks = (n - 1) // block_len
    for b in range(blocks):
        for st in range(stripes_per_block):
            accumulate(b * block_len + st * 64, st * 8)
        scramble()
    stripes = ((n - 1) - block_len * blocks) // 64
    for st in range(stripes):
        accumulate(blocks * block_len + st * 64, st * 8)
    accumulate(n - 64, secret_size - 64 - 7)
    result = (n * P64_1) & _M
    for k in range(4):
        result = (
            result
            + _fold(acc[2 * k] ^ _r64(_SECRET, 11 + 16 * k), acc[2 * k + 1] ^ _r64(_SECRET, 11 + 16 * k + 8))
        ) & _M
    return _avalanche(result)


def xxh3_64(data: bytes) -> int:
    """XXH3 64-bit hash of `data` with seed 0."""
    n = len(data)
    if n == 0:
        return _xxh64_avalanche(_r64(_SECRET, 56) ^ _r64(_SECRET, 64))
    if n <= 3:
        combined = (data[0] << 16) | (data[n >> 1] << 24) | data[n - 1] | (n << 8)
        return _xxh64_avalanche(combined ^ (_r32(_SECRET, 0) ^ _r32(_SECRET, 4)))
    if n <= 8:
        bitflip = _r64(_SECRET, 8) ^ _r64(_SECRET, 16)
        keyed = ((_r32(data, n - 4) + (_r32(data, 0) << 32)) & _M) ^ bitflip
        h = keyed ^ _rotl(keyed, 49) ^ _rotl(keyed, 24)
        h = (h * 0x9FB21C651E98DF25) & _M
        h ^= (h >> 35) + n
        h = (h * 0x9FB21C651E98DF25) & _M
        return h ^ (h >> 28)
    if n <= 16:
        lo = _r64(data, 0) ^ (_r64(_SECRET, 24) ^ _r64(_SECRET, 32))
        hi = _r64(data, n - 8) ^ (_r64(_SECRET, 40) ^ _r64(_SECRET, 48))
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche((n + swapped + hi + _fold(lo, hi)) & _M)
    if n <= 128:
        acc = (n * P64_1) & _M
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(data, 48, 96) + _mix16(data, n - 64, 112)
                acc += _mix16(data, 32, 64) + _mix16(data, n - 48, 80)
            acc += _mix16(data, 16, 32) + _mix16(data, n - 32, 48)
        acc += _mix16(data, 0, 0) + _mix16(data, n - 16, 16)
        return _avalanche(acc & _M)
    if n <= 240:
        acc = (n * P64_1) & _M
        for k in range(8):
            acc += _mix16(data, 16 * k, 16 * k)
        acc = _avalanche(acc & _M)
        for k in range(8, n // 16):
            acc += _mix16(data, 16 * k, 16 * (k - 8) + 3)
        acc += _mix16(data, n - 16, 136 - 17)
        return _avalanche(acc & _M)
    return _long(data)
