"""Packed e2m1 bytes widened through e4m3: integer operations on whole words, one conversion for two values.

An e2m1 code (sign bit 3, magnitude bits 2..0: 0, 0.5, 1, 1.5, 2, 3, 4, 6) is an e4m3 value once its sign
goes to bit 7 and its magnitude bits to bits 4..2 (the low exponent bits and the top mantissa bit): the
e4m3 byte is then the e2m1 value times 2^-6 exactly (code 1, e2m1's subnormal 0.5, lands on e4m3's
subnormal 2^-7). Hopper converts two e4m3 bytes to two fp16 values in one instruction
(`cvt.rn.f16x2.e4m3x2`), so a byte of two codes costs a handful of bit operations shared by the four
bytes of a word and one conversion. The FP4 per-pair path (`fp4_pairs`) widens its tiles so, on CUDA
cores: 0.78-0.89x the time of placing each nibble's bits in an fp16 alone (bench/notes/fp8.md).

The low nibble of a byte (DeepSeek's even column) and the high one (the odd column) come back as two
tiles of the byte tile's shape, so a product over K takes the even and the odd columns of the
activations apart, and no interleave is needed.

`ASM` picks the inline PTX (`hardware.e4m3_pairs_to_fp16`: NVIDIA GPUs from compute capability 8.9) over the
same operations in Triton's language (the interpreter's and other GPUs' path, and the values the PTX must give:
`tests/kernels/test_fp4_experts.py` checks every byte both ways).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Each e4m3 byte is the e2m1 value times 2^-6: a sum of widened values' products is undone by this factor.
E2M1_UNDO = 64.0

def _e2m1x4_to_e4m3(word: str) -> str:
    # Four packed bytes (the operand `word`) to their low nibbles' e4m3 bytes (lo) and their high nibbles' (hi),
    # then as pairs (a, b: bytes 0-1 and 2-3 of lo; c, d: of hi).
    return f"""
shl.b32 sgn, {word}, 4;
and.b32 sgn, sgn, 0x80808080;
shl.b32 mag, {word}, 2;
and.b32 mag, mag, 0x1c1c1c1c;
or.b32 lo, sgn, mag;
and.b32 sgn, {word}, 0x80808080;
shr.b32 mag, {word}, 2;
and.b32 mag, mag, 0x1c1c1c1c;
or.b32 hi, sgn, mag;
mov.b32 {{a, b}}, lo;
mov.b32 {{c, d}}, hi;
"""


def e2m1x4_to_f16_scaled_asm(word: str, scale_01: str, scale_23: str) -> str:
    """Inline PTX widening four packed bytes (operand `word`) to eight fp16 values times their scales: out
    operands $0, $1 the low nibbles' values (bytes 0-1, 2-3: two f16x2 registers), $2, $3 the high nibbles';
    scale_01 / scale_23 the f16x2 scales of bytes 0 and 1 / 2 and 3 (the same operand where one scale covers
    the word, as in `gluon.fp4_experts`)."""
    return ("{\n.reg .b32 sgn, mag, lo, hi, t0, t1, t2, t3;\n.reg .b16 a, b, c, d;\n" + _e2m1x4_to_e4m3(word) + f"""
cvt.rn.f16x2.e4m3x2 t0, a;
cvt.rn.f16x2.e4m3x2 t1, b;
cvt.rn.f16x2.e4m3x2 t2, c;
cvt.rn.f16x2.e4m3x2 t3, d;
mul.rn.f16x2 $0, t0, {scale_01};
mul.rn.f16x2 $1, t1, {scale_23};
mul.rn.f16x2 $2, t2, {scale_01};
mul.rn.f16x2 $3, t3, {scale_23};
}}
""")


# $0..$3: the low nibbles' four fp16 (two f16x2 registers), then the high nibbles'; $4: four packed bytes.
_E2M1X4_TO_F16 = tl.constexpr("{\n.reg .b32 sgn, mag, lo, hi;\n.reg .b16 a, b, c, d;\n" + _e2m1x4_to_e4m3("$4") + """
cvt.rn.f16x2.e4m3x2 $0, a;
cvt.rn.f16x2.e4m3x2 $1, b;
cvt.rn.f16x2.e4m3x2 $2, c;
cvt.rn.f16x2.e4m3x2 $3, d;
}
""")

# As _E2M1X4_TO_F16, each pair then times its bytes' fp16 scales ($5: bytes 0 and 1, $6: bytes 2 and 3).
_E2M1X4_TO_F16_SCALED = tl.constexpr(e2m1x4_to_f16_scaled_asm("$4", "$5", "$6"))


@triton.jit
def e2m1_to_fp16(packed, ASM: tl.constexpr):
    """packed [R, N] uint8, two e2m1 codes a byte -> (low [R, N], high [R, N]) fp16: each nibble's value
    times 2^-6 (`E2M1_UNDO`), exactly."""
    if ASM:
        low, high = tl.inline_asm_elementwise(_E2M1X4_TO_F16, "=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        # (sign << 4) | (magnitude << 2) of each nibble, in one byte: an e4m3 value.
        low8 = (((packed << 4) & 0x80) | ((packed << 2) & 0x1C)).to(tl.uint8)
        high8 = ((packed & 0x80) | ((packed >> 2) & 0x1C)).to(tl.uint8)
        low = low8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        high = high8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return low, high


@triton.jit
def e2m1_to_fp16_scaled(packed, scale, ASM: tl.constexpr):
    """packed [R, N] uint8 and scale [R, N] fp16 (one a byte) -> e2m1_to_fp16's (low, high), each times its
    byte's scale: one fp16 product for two values (exact where the product is an fp16 number)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(_E2M1X4_TO_F16_SCALED, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        low, high = e2m1_to_fp16(packed, False)
        low = low * scale
        high = high * scale
    return low, high
