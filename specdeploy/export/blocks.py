"""Matrices in MatMulNBits' block layout, and GGUF's quantized blocks turned into it exactly.

A `BlockMatrix` is what ONNX Runtime's MatMulNBits and GatherBlockQuantized read, plus one term
they do not have:

    weight[row, b * block_size + j] = scales[row, b] * (code[row, b, j] - 2 ** (bits - 1)) - mins[row, b]

codes [rows, n_blocks, block_size * bits // 8] uint8 (4 bits: two a byte, low nibble first),
scales [rows, n_blocks] float32, mins [rows, n_blocks] float32 or None (all zero). The zero point
is the operators' default (8 for 4 bits, 128 for 8 bits), never an input: a zero-point input costs
MatMulNBits' int8 kernels about a fifth of their speed, and a floating-point one turns prepacking
off (40-60x slower; docs/performance.md). A GGUF type with a minimum per block (Q4_1, Q5_1, Q4_K,
Q5_K) keeps it as `mins`, which the graph subtracts as sums of each block's inputs times the mins
(`blocks_matmul`): x @ W.T = MatMulNBits(x) - block_sums(x) @ mins.T.

Each GGUF type maps so that the weights are llama.cpp's own (gguf-py's `dequantize`, which the
tests compare against bit for bit):

| type | llama.cpp's value | here |
|---|---|---|
| Q4_0 | d (q - 8) | 4 bits, block 32, code q, scale d |
| Q4_1 | d q + m | 4 bits, block 32, code q, scale d, min -(m + 8 d) |
| Q5_0 | d (q - 16) | 8 bits, block 32, code q + 112, scale d |
| Q5_1 | d q + m | 8 bits, block 32, code q + 128, scale d, min -m |
| Q8_0 | d q | 8 bits, block 32, code q + 128, scale d |
| Q4_K | d sc q - dmin m | 4 bits, block 32, code q, scale d sc, min dmin m - 8 d sc |
| Q5_K | d sc q - dmin m | 8 bits, block 32, code q + 128, scale d sc, min dmin m |
| Q6_K | d sc (q - 32) | 8 bits, block 16, code q + 96, scale d sc |

A scale d sc is exact in float32 (an fp16 times a 6- or 8-bit integer). A 4-bit type's min is the
one figure rounded: it folds in the 8 of the default zero point, exact in float32 unless its two
terms lie more than 2^7 (K types) or 2^13 apart; then it is within half a unit in the last place of
the exact one. Every other weight is llama.cpp's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MS = "com.microsoft"


@dataclass(frozen=True)
class BlockMatrix:
    """A [rows, cols] matrix in MatMulNBits' layout (the module docstring); rows are a MatMul's output features."""

    codes: np.ndarray  # [rows, n_blocks, block_size * bits // 8] uint8
    scales: np.ndarray  # [rows, n_blocks] float32
    mins: np.ndarray | None  # [rows, n_blocks] float32, subtracted from every weight of its block; None: zero
    bits: int
    block_size: int
    source_type: str = ""  # the GGUF type it came from (Q4_K, ...), for reports

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def cols(self) -> int:
        return int(self.codes.shape[1]) * self.block_size

    @property
    def num_blocks(self) -> int:
        return int(self.codes.shape[1])

    def layout(self) -> tuple[int, int, bool]:
        """What two matrices must share to be stacked into one operator: bits, block size, whether mins exist."""
        return self.bits, self.block_size, self.mins is not None

    def take(self, rows: np.ndarray) -> "BlockMatrix":
        """These rows, in this order."""
        return BlockMatrix(self.codes[rows], self.scales[rows], None if self.mins is None else self.mins[rows],
                           self.bits, self.block_size, self.source_type)

    @staticmethod
    def stack(matrices: list["BlockMatrix"]) -> "BlockMatrix":
        """Their rows one after another (q, k and v into one qkv operator); all of one layout()."""
        first = matrices[0]
        if any(m.layout() != first.layout() or m.cols != first.cols for m in matrices):
            raise ValueError("only matrices of one layout and width stack")
        mins = None if first.mins is None else np.concatenate([m.mins for m in matrices])
        kinds = sorted({m.source_type for m in matrices})
        return BlockMatrix(np.concatenate([m.codes for m in matrices]), np.concatenate([m.scales for m in matrices]),
                           mins, first.bits, first.block_size, "+".join(kinds))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [rows, n_blocks, blob] -> one uint8 code per weight, [rows, n_blocks, block_size]."""
    if bits == 8:
        return codes
    return np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:2], -1)


def pack_codes(values: np.ndarray, bits: int) -> np.ndarray:
    """values [..., block_size] uint8 (each below 2 ** bits) -> MatMulNBits' bytes [..., block_size * bits // 8]."""
    if bits == 8:
        return np.ascontiguousarray(values, dtype=np.uint8)
    return np.ascontiguousarray(values[..., 0::2] | (values[..., 1::2] << 4), dtype=np.uint8)


def dequantize(matrix: BlockMatrix) -> np.ndarray:
    """The float32 [rows, cols] weights a BlockMatrix stands for: the reference for every kernel that reads one.

    scale * (code - zero point) is exact in float32 for every GGUF type (at most 24 significant bits);
    the min is then subtracted with one rounding, as llama.cpp subtracts its own."""
    offset = np.float32(1 << (matrix.bits - 1))
    values = matrix.scales[..., None] * (unpack_codes(matrix.codes, matrix.bits).astype(np.float32) - offset)
    if matrix.mins is not None:
        values = values - matrix.mins[..., None]
    return values.reshape(matrix.rows, matrix.cols).astype(np.float32, copy=False)


# --- GGUF's block types -------------------------------------------------------------------------------------------


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Two bytes a value [..., 2] uint8 -> float32 [...] (little-endian fp16, as GGUF stores d and m)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """Q4_0 / Q5_0's 16 bytes a block [n, 16] -> 32 values [n, 32]: the low nibbles are values 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K / Q5_K super-block [n, 12] -> its eight 6-bit scales and mins, [n, 8] each (uint8)."""
    low, high = packed[:, 0:4], packed[:, 4:8]
    extra = packed[:, 8:12]
    scales = np.concatenate([low & 63, (extra & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=1)
    return scales, mins


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes [n, 128] -> the 4 low bits of 256 values [n, 8, 32]: 32 bytes a pair of
    sub-blocks, the low nibbles the even sub-block, the high the odd one."""
    groups = qs.reshape(len(qs), 4, 1, 32)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=2).reshape(len(qs), 8, 32)


def _min_after_offset(minimum: np.ndarray, scale: np.ndarray, offset: int) -> np.ndarray:
    """minimum + offset * scale, in float64 and rounded once: a 4-bit type's min with the default zero point folded in."""
    return (minimum.astype(np.float64) + offset * scale.astype(np.float64)).astype(np.float32)


def _q4_0(blocks: np.ndarray):  # [n, 18]: d, 16 bytes of nibbles
    return _nibbles_split(blocks[:, 2:]), _fp16(blocks[:, 0:2])[:, None], None


def _q4_1(blocks: np.ndarray):  # [n, 20]: d, m, 16 bytes of nibbles; value d q + m
    d, m = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    return _nibbles_split(blocks[:, 4:]), d[:, None], _min_after_offset(-m, d, -8)[:, None]


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's four bytes of fifth bits [n, 4] -> [n, 32] (bit j of the little-endian word is value j's)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _q5_0(blocks: np.ndarray):  # [n, 22]: d, 32 high bits, 16 bytes of nibbles; value d (q - 16)
    q = _nibbles_split(blocks[:, 6:]) | (_q5_high_bits(blocks[:, 2:6]) << 4)
    return q + np.uint8(112), _fp16(blocks[:, 0:2])[:, None], None


def _q5_1(blocks: np.ndarray):  # [n, 24]: d, m, 32 high bits, 16 bytes of nibbles; value d q + m
    q = _nibbles_split(blocks[:, 8:]) | (_q5_high_bits(blocks[:, 4:8]) << 4)
    return q + np.uint8(128), _fp16(blocks[:, 0:2])[:, None], -_fp16(blocks[:, 2:4])[:, None]


def _q8_0(blocks: np.ndarray):  # [n, 34]: d, 32 int8 values
    return blocks[:, 2:] ^ np.uint8(0x80), _fp16(blocks[:, 0:2])[:, None], None  # q + 128, as unsigned bytes


def _q4_k(blocks: np.ndarray):  # [n, 144]: d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, m = _k_scales(blocks[:, 4:16])
    scales = d[:, None] * sc.astype(np.float32)  # [n, 8], exact
    mins = _min_after_offset(dmin[:, None] * m.astype(np.float32), scales, -8)
    return _k_low_nibbles(blocks[:, 16:]).reshape(len(blocks), 256), scales, mins


def _q5_k(blocks: np.ndarray):  # [n, 176]: d, dmin, 12 bytes of scales and mins, 32 of fifth bits, 128 of nibbles
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, m = _k_scales(blocks[:, 4:16])
    # bit i of qh[l] is the fifth bit of value l of sub-block i
    high = np.unpackbits(blocks[:, 16:48][:, None, :], axis=1, count=8, bitorder="little")  # [n, 8, 32]
    q = _k_low_nibbles(blocks[:, 48:]) | (high << 4)
    return (q + np.uint8(128)).reshape(len(blocks), 256), d[:, None] * sc.astype(np.float32), dmin[:, None] * m.astype(np.float32)


def _q6_k(blocks: np.ndarray):  # [n, 210]: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d
    n = len(blocks)
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = np.concatenate([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=2).reshape(n, 8, 32)
    q = low | (high << 4)  # 0..63, value d sc (q - 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _fp16(np.ascontiguousarray(blocks[:, 208:210]))
    return (q + np.uint8(96)).reshape(n, 256), d[:, None] * sc, None


@dataclass(frozen=True)
class GgufBlockType:
    """How one GGML type's blocks become a BlockMatrix."""

    values_per_block: int  # GGUF's block (super-block for the K types)
    bytes_per_block: int
    bits: int  # MatMulNBits' bits
    block_size: int  # MatMulNBits' block
    convert: object  # blocks [n, bytes_per_block] uint8 -> (codes [n, values], scales [n, k], mins [n, k] | None)


GGUF_BLOCK_TYPES: dict[str, GgufBlockType] = {
    "Q4_0": GgufBlockType(32, 18, 4, 32, _q4_0),
    "Q4_1": GgufBlockType(32, 20, 4, 32, _q4_1),
    "Q5_0": GgufBlockType(32, 22, 8, 32, _q5_0),
    "Q5_1": GgufBlockType(32, 24, 8, 32, _q5_1),
    "Q8_0": GgufBlockType(32, 34, 8, 32, _q8_0),
    "Q4_K": GgufBlockType(256, 144, 4, 32, _q4_k),
    "Q5_K": GgufBlockType(256, 176, 8, 32, _q5_k),
    "Q6_K": GgufBlockType(256, 210, 8, 16, _q6_k),
}


def from_gguf(raw: np.ndarray, type_name: str, cols: int) -> BlockMatrix:
    """GGUF rows of one tensor, raw [rows, bytes a row] uint8, as a BlockMatrix of the same values (the table above)."""
    kind = GGUF_BLOCK_TYPES[type_name]
    rows = raw.shape[0]
    per_row = cols // kind.values_per_block
    if cols % kind.values_per_block or raw.shape[1] != per_row * kind.bytes_per_block:
        raise ValueError(f"{type_name}: {raw.shape[1]} bytes a row do not hold {cols} values")
    codes, scales, mins = kind.convert(np.ascontiguousarray(raw).reshape(rows * per_row, kind.bytes_per_block))
    n_blocks = cols // kind.block_size
    codes = pack_codes(codes.reshape(rows, n_blocks, kind.block_size), kind.bits)
    scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, n_blocks)
    mins = None if mins is None else np.ascontiguousarray(mins, dtype=np.float32).reshape(rows, n_blocks)
    return BlockMatrix(codes, scales, mins, kind.bits, kind.block_size, type_name)
