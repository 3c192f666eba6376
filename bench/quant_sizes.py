"""The README's quantized-DiT table: what each stored form of the Wan 2.1 T2V DiTs takes on the GPU (bf16 compute).

    .venv/bin/python bench/quant_sizes.py            # both sizes, markdown

From the released models' shapes (``original_key_shapes(config_for_size(...))``, equal to
``shared/research/wan21_t2v_key_shapes.json``) and the loader's own rule for what stays in stored form
(``loaders.dit_build.stays_stored``: 2-D Linear weights outside the fp32 time embedding); every other tensor is bf16
(the time embedding fp32). A uniform GGUF type is assumed: Q4_K_M / Q5_K_M files keep some tensors at Q6_K, so they
are a little larger than the Q4_K / Q5_K rows. fp8_e4m3fn is SDVG's own fp8 storage of a bf16 file (diffusers
layerwise casting).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdvg.loaders.dit_build import stays_stored, stored_form_bytes  # noqa: E402
from sdvg.loaders.wan_keys import config_for_size, original_key_shapes  # noqa: E402

GIB = 2**30


def device_bytes(shapes: dict, kind: str) -> int:
    """Bytes on the device for stored form ``kind`` (bf16, SDVG's fp8 storage, or a stored form of the loader)."""
    if kind == "bf16":
        return sum(math.prod(s) * (4 if k.startswith("time_embedding.") else 2) for k, s in shapes.items())
    if kind == "fp8_e4m3fn":
        return sum(math.prod(s) * (1 if len(s) == 2 else 4 if k.startswith("time_embedding.") else 2)
                   for k, s in shapes.items())
    return sum(stored_form_bytes(shapes, kind).values())


def main() -> int:
    kinds = ("bf16", "fp8_e4m3fn", "fp8_scaled", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0")
    out = sys.stdout
    out.write("| stored form | stays quantized on the device | 14B | 1.3B |\n|---|---|---|---|\n")
    sizes = {s: original_key_shapes(config_for_size(s)) for s in ("14B", "1.3B")}
    for kind in kinds:
        kept = {"bf16": "nothing", "fp8_e4m3fn": "fp8 storage of a bf16 file, cast per layer"}.get(
            kind, "every 2-D Linear weight but the time embedding's")
        b14, b13 = device_bytes(sizes["14B"], kind), device_bytes(sizes["1.3B"], kind)
        out.write(f"| {kind} | {kept} | {b14 / GIB:.2f} GiB | {b13 / GIB:.2f} GiB |\n")
    largest = max(math.prod(s) for k, s in sizes["14B"].items() if stays_stored(k, s, "Q4_K"))
    out.write(f"\nlargest layer dequantized per call (14B): {largest / 1e6:.0f} M weights, "
              f"{4 * largest / GIB:.2f} GiB in fp32 while computed\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
