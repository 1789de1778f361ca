"""MXFP4 weights (OCP microscaling FP4, as gpt-oss checkpoints store their experts): each group of 32
values is 16 bytes of e2m1 codes (two per byte, the low nibble first) and one byte of shared exponent
(2 ** (e - 127)). The engine dequantises them at load into the model's float weights."""
import torch

# e2m1: sign, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., rows, G, 16] uint8 and scales [..., rows, G] uint8 to [..., G * 32, rows] of `dtype`:
    the layout of gpt-oss's expert weights (gate_up_proj [E, hidden, 2 * inter]), which store each
    output row's input columns in groups."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks [..., rows, groups, 16] and scales [..., rows, groups] do not match: "
                         f"{list(blocks.shape)} and {list(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()               # low nibble first
    values = lut[codes].flatten(-2)                                                # [..., rows, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()             # [..., G * 32, rows]


def pair_tensors(names) -> dict[str, tuple[str, str]]:
    """{weight name: (blocks name, scales name)} of the MXFP4 pairs among `names`; raises for a half pair."""
    names = set(names)
    pairs = {}
    for name in names:
        if name.endswith(BLOCKS_SUFFIX):
            base = name[: -len(BLOCKS_SUFFIX)]
            if base + SCALES_SUFFIX not in names:
                raise ValueError(f"checkpoint tensor {name!r} (MXFP4) has no {base + SCALES_SUFFIX!r}")
            pairs[base] = (name, base + SCALES_SUFFIX)
        elif name.endswith(SCALES_SUFFIX) and name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX not in names:
            raise ValueError(f"checkpoint tensor {name!r} (MXFP4) has no {name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX!r}")
    return pairs
