"""How a gradient travels between ranks: the compression spec, and CGX's codec (bucketed max-min
quantization with levels packed densely into bytes).

``quantize`` cuts a tensor into buckets of ``bucket_size`` elements, stores each bucket's min and
scale, and packs every element's level (``bits`` bits, 1..8) into bytes; ``dequantize`` undoes it;
``wire_bytes`` is the exact size on the wire. ``runtime/comm/collectives.py`` runs the all-reduce with it.

    >>> p = quantize(torch.linspace(0, 1, 1000), bits=4, bucket_size=512, rounding="nearest")
    >>> p.nbytes, wire_bytes(1000, 4, 512)      # 500 bytes of levels + 2 buckets x (min, scale)
    (516, 516)
    >>> float((dequantize(p) - torch.linspace(0, 1, 1000)).abs().max()) <= float(p.scales.max()) / 2
    True
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

import torch

from harmony.base.errors import ConfigError
from harmony.base.units import nbytes

KINDS = ("none", "fp16", "bf16", "quantized")
ROUNDINGS = ("stochastic", "nearest")
META_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
DEFAULT_MIN_SIZE = 16            # CGX leaves layers smaller than this uncompressed
BLOCK_ELEMENTS = 1 << 16         # elements the codec works on at a time (its scratch fits a core's L2 cache)
LITTLE_ENDIAN = sys.byteorder == "little"


# -- the compression spec -------------------------------------------------------------------------
@dataclass(frozen=True)
class CompressionSpec:
    """How one tensor travels: ``kind`` none | fp16 | bf16 | quantized.

    ``bits`` (1..8), ``bucket_size`` (elements sharing one min and scale), ``rounding``
    (stochastic | nearest) and ``meta`` (fp32 | fp16, dtype of min and scale on the wire)
    apply to ``quantized``. ``error_feedback`` keeps what compression lost and adds it to the
    next call's input (needs an ``error_feedback_state`` dict passed to ``allreduce``).
    """

    kind: str = "quantized"
    bits: int = 4
    bucket_size: int = 512
    rounding: str = "stochastic"
    error_feedback: bool = False
    meta: str = "fp32"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"CompressionSpec.kind={self.kind!r} is not one of {KINDS}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ConfigError(f"CompressionSpec.bits={self.bits!r} is out of range: use an integer in 1..8")
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ConfigError(f"CompressionSpec.bucket_size={self.bucket_size!r} is invalid: use an integer >= 1")
        if self.rounding not in ROUNDINGS:
            raise ConfigError(f"CompressionSpec.rounding={self.rounding!r} is not one of {ROUNDINGS}")
        if self.meta not in META_DTYPES:
            raise ConfigError(f"CompressionSpec.meta={self.meta!r} is not one of {tuple(META_DTYPES)}")

    @property
    def lossy(self) -> bool:
        return self.kind != "none"

    @property
    def meta_dtype(self) -> torch.dtype:
        return META_DTYPES[self.meta]


NO_COMPRESSION = CompressionSpec("none")


def spec_for(tensor: torch.Tensor, spec: CompressionSpec, min_size: int = DEFAULT_MIN_SIZE) -> CompressionSpec:
    """The spec ``tensor`` actually travels with: uncompressed if ``dim <= 1`` or ``numel < min_size``.

    >>> spec_for(torch.zeros(768), CompressionSpec(bits=4)).kind
    'none'
    """
    if spec.kind == "none" or tensor.dim() <= 1 or tensor.numel() < min_size:
        return NO_COMPRESSION
    return spec


# -- bit packing ----------------------------------------------------------------------------------
def pack_bits(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``levels`` (< 2**bits) densely: 8 values -> ``bits`` bytes, little-endian bit order.

    Returns ``ceil(numel * bits / 8)`` bytes. Vectorised: one op per (value slot, byte) pair of
    an 8-value group, at most 16 ops whatever the length.

    >>> pack_bits(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8), 3).tolist()
    [209, 88, 31]
    """
    _check_bits(bits)
    levels = levels.reshape(-1).to(torch.uint8)
    n = levels.numel()
    if bits == 8:
        return levels.clone()
    if 8 % bits == 0:      # whole values per byte (1, 2, 4 bits): one op per slot of a byte, on n / k values
        k = 8 // bits
        if n % k:
            levels = torch.cat([levels, levels.new_zeros(k - n % k)])
        if bits == 4 and LITTLE_ENDIAN:   # a pair of bytes read as one int16 is b0 | b1 << 8: its low byte after
            u = levels.view(torch.int16)  # u | u >> 4 is b0 | b1 << 4, with no strided access
            return (u | (u >> 4)).to(torch.uint8)
        v = levels.view(-1, k)
        out = v[:, 0].clone()
        for j in range(1, k):
            out |= v[:, j] << (bits * j)
        return out
    groups = -(-n // 8)
    if groups * 8 != n:
        levels = torch.cat([levels, levels.new_zeros(groups * 8 - n)])
    v = levels.view(groups, 8)
    out = torch.zeros(groups, bits, dtype=torch.uint8, device=levels.device)
    for i in range(8):
        start = bits * i                 # first bit of value i inside its group
        byte, shift = divmod(start, 8)
        out[:, byte] |= v[:, i] << shift  # uint8 shift drops the bits that spill over
        if shift + bits > 8:
            out[:, byte + 1] |= v[:, i] >> (8 - shift)
    return out.view(-1)[: -(-n * bits // 8)]


def unpack_bits(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``numel`` uint8 levels from densely packed bytes."""
    _check_bits(bits)
    if bits == 8:
        return data[:numel].clone()
    mask = (1 << bits) - 1
    if 8 % bits == 0:      # whole values per byte: as pack_bits, one op per slot
        k = 8 // bits
        d = data[: -(-numel // k)]
        if bits == 4 and LITTLE_ENDIAN:   # each byte to an int16 whose low byte is its low nibble, high byte its high
            u = d.to(torch.int16)
            return ((u & 15) | ((u >> 4) << 8)).view(torch.uint8)[:numel]
        out = torch.empty(d.numel(), k, dtype=torch.uint8, device=data.device)
        for j in range(k):
            torch.bitwise_and(d >> (bits * j) if j else d, mask, out=out[:, j])
        return out.view(-1)[:numel]
    groups = -(-numel // 8)
    need = groups * bits
    if data.numel() < need:
        data = torch.cat([data, data.new_zeros(need - data.numel())])
    d = data[:need].view(groups, bits)
    out = torch.empty(groups, 8, dtype=torch.uint8, device=data.device)
    for i in range(8):
        byte, shift = divmod(bits * i, 8)
        v = d[:, byte] >> shift
        if shift + bits > 8:
            v = v | (d[:, byte + 1] << (8 - shift))
        out[:, i] = v & mask
    return out.view(-1)[:numel]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ConfigError(f"bits={bits!r} is out of range: use an integer in 1..8")


# -- bucketed max-min quantization ----------------------------------------------------------------
@dataclass
class Packed:
    """A quantized tensor: per-bucket ``mins`` and ``scales`` plus densely packed levels."""

    data: torch.Tensor     # uint8, ceil(numel * bits / 8) bytes
    mins: torch.Tensor     # (buckets,) meta dtype
    scales: torch.Tensor   # (buckets,) meta dtype; value = min + level * scale
    numel: int
    bits: int
    bucket_size: int
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.data.numel() + nbytes(self.mins) * 2

    def to_wire(self) -> torch.Tensor:
        """One uint8 tensor: mins, scales, levels -- exactly ``nbytes`` long."""
        return torch.cat([self.mins.view(torch.uint8), self.scales.view(torch.uint8), self.data])

    @staticmethod
    def wire_levels(buf: torch.Tensor, numel: int, bits: int, bucket_size: int,
                    meta_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The part of a wire message ``buf`` (as ``to_wire`` lays it out) that holds the packed levels: pass it
        as ``quantize(..., out=)`` and then ``write_meta(buf)`` to build the message without a copy."""
        m = _meta_bytes(numel, bucket_size, meta_dtype)
        return buf[2 * m: 2 * m + -(-numel * bits // 8)]

    def write_meta(self, buf: torch.Tensor) -> None:
        """Write mins and scales to the head of wire message ``buf`` (whose levels ``quantize`` wrote in place)."""
        m = nbytes(self.mins)
        buf[:m] = self.mins.view(torch.uint8)
        buf[m: 2 * m] = self.scales.view(torch.uint8)

    @classmethod
    def from_wire(cls, buf: torch.Tensor, numel: int, bits: int, bucket_size: int,
                  meta_dtype: torch.dtype = torch.float32, shape=None) -> "Packed":
        buckets, m = -(-numel // bucket_size), _meta_bytes(numel, bucket_size, meta_dtype)
        meta = buf[: 2 * m].clone().view(meta_dtype)   # clone: the slice may be misaligned
        return cls(buf[2 * m: 2 * m + -(-numel * bits // 8)], meta[:buckets], meta[buckets:],
                   numel, bits, bucket_size, torch.Size(shape if shape is not None else (numel,)))


def _meta_bytes(numel: int, bucket_size: int, meta_dtype: torch.dtype) -> int:
    return -(-numel // bucket_size) * torch.tensor([], dtype=meta_dtype).element_size()


def wire_bytes(numel: int, bits: int, bucket_size: int = 512, meta_dtype: torch.dtype = torch.float32) -> int:
    """Exact bytes of ``quantize(t, bits, bucket_size)`` on the wire for a tensor of ``numel`` elements."""
    _check_bits(bits)
    return -(-numel * bits // 8) + 2 * _meta_bytes(numel, bucket_size, meta_dtype)


def quantize(t: torch.Tensor, bits: int, bucket_size: int = 512, rounding: str = "stochastic",
             generator: torch.Generator | None = None, meta_dtype: torch.dtype = torch.float32,
             out: torch.Tensor | None = None) -> Packed:
    """Bucketed max-min quantization of ``t`` to ``bits`` bits per element.

    Each bucket of ``bucket_size`` consecutive elements stores its min and
    ``scale = (max - min) / (2**bits - 1)``; an element becomes the level
    ``round((x - min) / scale)`` (nearest: error <= scale/2) or ``floor((x - min) / scale + u)``
    with ``u`` uniform over the midpoints of 65536 equal cells of (0, 1) (stochastic: error <
    scale, unbiased to within 2**-17 of a step). Levels are packed densely (``pack_bits``), into ``out`` (uint8,
    ``ceil(numel * bits / 8)`` bytes) if given: the packed levels of a wire message can be written in place.

    >>> p = quantize(torch.tensor([0.0, 0.3, 1.0]), bits=2, rounding="nearest")
    >>> dequantize(p).tolist()
    [0.0, 0.3333333432674408, 1.0]
    """
    _check_bits(bits)
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding={rounding!r} is not one of {ROUNDINGS}")
    x = t.detach().reshape(-1).float()
    n = x.numel()
    if n == 0:
        empty = x.new_zeros(0).to(meta_dtype)
        return Packed(x.new_zeros(0, dtype=torch.uint8), empty, empty.clone(), 0, bits, bucket_size, t.shape)
    lo, scale = _bucket_ranges(x, bits, bucket_size, meta_dtype)
    data = _pack_levels(x, lo, scale, out, bits, bucket_size, rounding, generator)
    return Packed(data, lo.to(meta_dtype), scale.to(meta_dtype), n, bits, bucket_size, t.shape)


def _bucket_ranges(x: torch.Tensor, bits: int, bucket_size: int,
                   meta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each bucket's min and scale (``(max - min) / (2**bits - 1)``) of flat, non-empty ``x``, a partial last
    bucket with its own range; rounded to ``meta_dtype`` where that is not fp32 (``_round_meta``)."""
    n, top = x.numel(), (1 << bits) - 1
    buckets, full = -(-n // bucket_size), n // bucket_size
    head = x[: full * bucket_size].view(full, bucket_size)
    lo, hi = head.amin(dim=1), head.amax(dim=1)  # (torch's CPU aminmax over rows is not vectorised; these two are)
    if full < buckets:                            # a partial last bucket: its own range
        rest = x[full * bucket_size:]
        lo, hi = torch.cat([lo, rest.amin()[None]]), torch.cat([hi, rest.amax()[None]])
    scale = (hi - lo) / top
    if meta_dtype != torch.float32:
        lo, scale = _round_meta(lo, hi, scale, top, meta_dtype)
    return lo, scale


def _levels_buffer(out: torch.Tensor | None, n: int, bits: int, device: torch.device) -> torch.Tensor:
    """Where the packed levels of ``n`` elements go: ``out`` (checked to be exactly their uint8 bytes), else a new
    tensor."""
    size = -(-n * bits // 8)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != size):
        raise ConfigError(f"quantize(out=...) needs {size} uint8 bytes for {n} elements at {bits} bits; "
                          f"got {out.numel()} of {out.dtype}")
    return torch.empty(size, dtype=torch.uint8, device=device) if out is None else out


def _pack_levels(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None, bits: int,
                 bucket_size: int, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """The level of every element of flat ``x`` in its bucket's range (``lo``, ``scale``), packed into ``out`` (or
    a new tensor, ``_levels_buffer``), which it returns.

    A block of buckets at a time, through scratch buffers that stay in a core's cache: the eight passes
    below then cost about what one pass over memory does. Blocks hold a multiple of 8 elements, so each
    packs into whole bytes and draws whole random words: the result is bitwise the whole-tensor one.
    """
    n, top = x.numel(), (1 << bits) - 1
    buckets = -(-n // bucket_size)
    lo32, scale32 = lo.float(), scale.float()
    inv = torch.where(scale32 > 0, 1.0 / scale32, torch.zeros_like(scale32))
    # y = (x - min) / scale + u and the level is floor(y); u = 1/2 (nearest) or uniform in (0, 1)
    # (stochastic: 0.5 + (k + 1/2) / 65536 with k a uniform int16 -- a 16-bit dither, 4 per
    # random int64). u's constant part is folded into the subtraction to save a pass.
    offset = 0.5 if rounding == "nearest" else 0.5 + 0.5 / 65536
    shift = lo32 - offset * scale32
    data = _levels_buffer(out, n, bits, x.device)
    rows = min(_block_rows(bucket_size), buckets)   # scratch no larger than the tensor (one block: no alignment)
    y_buf = torch.empty(rows, bucket_size, device=x.device)
    levels_buf = torch.empty(rows * bucket_size, dtype=torch.uint8, device=x.device)
    if rounding == "stochastic":
        words_buf = torch.empty(-(-rows * bucket_size // 4), dtype=torch.int64, device=x.device)
        dither_buf = torch.empty(rows * bucket_size, device=x.device)
    for r0 in range(0, buckets, rows):
        r1 = min(r0 + rows, buckets)
        y = y_buf[: r1 - r0]
        torch.sub(_buckets(x, r0, r1, bucket_size), shift[r0:r1, None], out=y).mul_(inv[r0:r1, None])
        flat = y.view(-1)
        if rounding == "stochastic":
            words = words_buf[: -(-flat.numel() // 4)]
            words.random_(-2**63, 2**63 - 1, generator=generator)
            # converted first: torch's int16 + float add is several times slower than the conversion and a float add
            dither = dither_buf[: flat.numel()]
            dither.copy_(words.view(torch.int16)[: flat.numel()])
            flat.add_(dither, alpha=1 / 65536)
        first, last = r0 * bucket_size, min(r1 * bucket_size, n)
        levels = levels_buf[: last - first]
        levels.copy_(flat[: last - first].clamp_(0, top))     # truncation == floor for y >= 0
        data[first * bits // 8: -(-last * bits // 8)] = pack_bits(levels, bits)
    return data


def _buckets(x: torch.Tensor, r0: int, r1: int, bucket_size: int) -> torch.Tensor:
    """Buckets ``r0:r1`` of flat ``x`` as rows; a partial last bucket is padded with its last value (its range
    is unchanged, and the padding's levels are never packed)."""
    first, last = r0 * bucket_size, r1 * bucket_size
    if last <= x.numel():
        return x[first:last].view(r1 - r0, bucket_size)
    return torch.cat([x[first:], x[-1:].expand(last - x.numel())]).view(r1 - r0, bucket_size)


def _block_rows(bucket_size: int) -> int:
    """Buckets per block of the codec: about ``BLOCK_ELEMENTS`` elements, a multiple of 8 of them."""
    rows = max(1, BLOCK_ELEMENTS // bucket_size)
    while rows * bucket_size % 8:
        rows += 1
    return rows


def _round_meta(lo, hi, scale, top, dtype):
    """Round min down and scale up to ``dtype`` so [min, min + top * scale] still covers the bucket."""
    info = torch.finfo(dtype)
    lo_h = lo.clamp(info.min, info.max).to(dtype)
    lo_h = torch.where(lo_h.float() > lo, torch.nextafter(lo_h, lo_h.new_tensor(-math.inf)), lo_h)
    scale_h = ((hi - lo_h.float()) / top).clamp(max=info.max).to(dtype)
    scale_h = torch.where(lo_h.float() + scale_h.float() * top < hi,
                          torch.nextafter(scale_h, scale_h.new_tensor(math.inf)), scale_h)
    return lo_h, scale_h


def dequantize(p: Packed, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """fp32 tensor of ``p.shape`` from a ``Packed`` (written into ``out``, a flat fp32 tensor, if given).

    ``accumulate``: add the values to ``out`` instead (bitwise ``out += dequantize(p)``, without writing the
    values to memory first: a block at a time, as ``quantize`` works).
    """
    if out is None:
        if accumulate:
            raise ConfigError("dequantize(accumulate=True) adds to out: pass out")
        out = torch.empty(p.numel, dtype=torch.float32, device=p.data.device)
    scales, mins, bs = p.scales.float(), p.mins.float(), p.bucket_size
    full = p.numel // bs                   # whole buckets, a block at a time, then the partial one
    rows = max(1, min(_block_rows(bs), full))   # (scratch no larger than the tensor, as in quantize)
    if accumulate and full:
        values = torch.empty(rows, bs, device=out.device)
    for r0 in range(0, full, rows):
        r1 = min(r0 + rows, full)
        first, last = r0 * bs, r1 * bs
        levels = unpack_bits(p.data[first * p.bits // 8:], p.bits, last - first)
        block = out[first:last].view(r1 - r0, bs)
        dst = values[: r1 - r0] if accumulate else block
        # uint8 to fp32 first: torch's mixed-dtype multiply is slower than the conversion and a float one
        dst.copy_(levels.view(r1 - r0, bs))
        dst.mul_(scales[r0:r1, None]).add_(mins[r0:r1, None])
        if accumulate:
            block.add_(dst)
    if full < p.mins.numel():             # the last, partial bucket
        first = full * bs
        aligned = first // 8 * 8           # the bucket may start inside a byte: unpack from a whole byte
        levels = unpack_bits(p.data[aligned * p.bits // 8:], p.bits, p.numel - aligned)[first - aligned:]
        tail = torch.mul(levels, scales[full:]).add_(mins[full:])
        out[first: p.numel].add_(tail) if accumulate else out[first: p.numel].copy_(tail)
    return out.view(p.shape) if out.numel() == math.prod(p.shape) else out


NAMED = ("none", "fp32", "fp16", "bf16", "Nbit (N in 1..8)", "adaptive")


# -- the user's compression argument --------------------------------------------------------------
def parse_compression(compression) -> tuple[CompressionSpec, bool]:
    """``compression=`` of ``harmony.compile`` -> (spec, adaptive).

    ``None``/"none"/"fp32": plain fp32; "fp16"/"bf16"; "4bit" (any of 1..8): quantized, stochastic
    rounding, buckets of 512; "adaptive": per-layer bits chosen after a warm-up so that the total
    error is at most uniform 4-bit's; or a ``CompressionSpec``.
    """
    if compression is None:
        return NO_COMPRESSION, False
    if isinstance(compression, CompressionSpec):
        return compression, False
    if isinstance(compression, str):
        c = compression.strip().lower()
        if c in ("none", "fp32"):
            return NO_COMPRESSION, False
        if c in ("fp16", "bf16"):
            return CompressionSpec(c), False
        if c == "adaptive":
            return CompressionSpec("quantized", bits=4), True
        m = re.fullmatch(r"(\d+)[- ]?bits?", c)
        if m:
            return CompressionSpec("quantized", bits=int(m[1])), False   # bits out of 1..8: ConfigError there
    raise ConfigError(f"compression={compression!r}: use None, one of {', '.join(NAMED)}, "
                      f"or a harmony.runtime.comm.compression.CompressionSpec")
