"""A prompt's causal attention after its cached positions: tformer's kernel (gemv.attend_causal) against
PyTorch's flash kernel (F.scaled_dot_product_attention: is_causal with nothing cached, else the offset
causal mask the model builds), at the shapes of generate's prefill and of the server's prompt chunks
(`tformer serve --prefill-tokens`, 128 by default) on GPT-2-small's 12 heads of 64, in fp32 or bf16 (a bf16
model's queries, keys and values). Each path is checked against the other first; medians of 5 timings, µs per
call, and the ratio.

    python benchmarks/causal_attention.py [--dtype bf16]
"""

import argparse

import torch
import torch.nn.functional as F

from decode_attention import per_call_us  # this folder's: the same timing
from tformer.kernels import gemv
from tformer.model.masks import self_attention_mask

CASES = [  # name, cached positions, new queries
    ("prompt of 128", 0, 128),
    ("prompt of 512", 0, 512),
    ("chunk of 128 after 128", 128, 128),
    ("chunk of 128 after 256", 256, 128),
    ("chunk of 56 after 200", 200, 56),
    ("chunk of 128 after 896", 896, 128),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[p.parse_args().dtype]
    if not gemv.available():
        raise SystemExit(f"error: the kernel is not built here ({gemv.unsupported() or 'run make'})")
    torch.manual_seed(0)
    H, hd = 12, 64
    for name, offset, T in CASES:
        L = offset + T
        q = torch.randn(T, 3 * H * hd, dtype=dtype)[:, :H * hd].view(T, H, hd)   # as split from QKV
        k, v = (torch.randn(1, H, 1024, hd, dtype=dtype)[:, :, :L] for _ in range(2))   # a cache's filled part
        mask = self_attention_mask(T, offset, None, causal=True)
        qh = q.transpose(0, 1)[None]                                             # (1, H, T, hd)
        paths = {
            "SDPA": lambda: F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, is_causal=mask is None)
            .transpose(1, 2).reshape(T, H * hd),
            "gemv.attend_causal": lambda: gemv.attend_causal(q, k[0], v[0], hd ** -0.5),
        }
        bound = 1e-5 if dtype == torch.float32 else 2e-2                        # bf16: rounded outputs
        torch.testing.assert_close(paths["gemv.attend_causal"](), paths["SDPA"](), atol=bound, rtol=bound)
        us = {p: per_call_us(fn, 50) for p, fn in paths.items()}
        print(f"{name:26s}" + "  ".join(f"{p} {t:8.1f} µs" for p, t in us.items())
              + f"  kernel {us['SDPA'] / us['gemv.attend_causal']:.2f}x", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
