"""Does this torch's `torch._scaled_mm` take DeepSeek-style block scales (activations 1 x 128, weights 128 x 128,
float32) on this GPU, and is it faster than our Triton `fp8_linear` over the same FP8 weight? (GPU probe.)

    python packages/deepinfer-kernels/benchmarks/probe_scaled_mm.py

Only 128 x 128 weight blocks can go through `_scaled_mm` (V4-Flash); V4.1's 32 x 32 blocks cannot without
re-quantizing the weights. Every variant's output is compared with the dequantized reference matmul (bf16
activations quantized per 1 x 128 as the kernel does, fp32 accumulation); times are `triton.testing.do_bench`
medians (eager launches, activation quantization included).
"""

from __future__ import annotations

import torch
import triton
from deepinfer_kernels.linear import fp8_linear

E4M3_MAX = 448.0


def quant_rows(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, K/group]) per 1 x group block."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    s = g.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    return (g / s[..., None]).to(torch.float8_e4m3fn).view(m, k), s


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    print("torch", torch.__version__, torch.cuda.get_device_name())
    for n, k in ((8192, 4096), (4096, 4096), (2048, 4096)):
        w = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        ws = torch.rand(n // 128, k // 128, device=dev) * 0.01 + 0.001
        wd = (w.float().view(n // 128, 128, k // 128, 128) * ws[:, None, :, None]).view(n, k)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = quant_rows(x)
            ref = (xq.float().view(m, k // 128, 128) * xs[..., None]).view(m, k) @ wd.t()
            tri = fp8_linear(x, w, ws, (128, 128), act_quant=True)
            t_tri = triton.testing.do_bench(lambda x=x, w=w, ws=ws: fp8_linear(x, w, ws, (128, 128), act_quant=True))
            err_tri = ((tri.float() - ref).abs().max() / ref.abs().max()).item()
            line = f"N {n} K {k} M {m}: triton {t_tri * 1e3:.1f} us (err {err_tri:.1e})"
            for name, sb in (("scale_b [N/128,K/128]", ws), ("scale_b [K/128,N/128]", ws.t()),
                             ("scale_b [K/128,N/128] contiguous", ws.t().contiguous())):
                try:
                    def run(x=x, w=w, sb=sb):
                        a, sa = quant_rows(x)
                        return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

                    y = run()
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    t = triton.testing.do_bench(run)
                    line += f" | _scaled_mm {name}: {t * 1e3:.1f} us (err {err:.1e})"
                except Exception as exc:  # noqa: BLE001 - a probe: report what this torch refuses
                    line += f" | _scaled_mm {name}: {type(exc).__name__}: {str(exc)[:90]}"
            print(line)


if __name__ == "__main__":
    main()
