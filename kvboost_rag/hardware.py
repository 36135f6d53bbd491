"""What this machine computes in hardware: a CPU's instruction sets, and whether a dtype's matmuls run natively.

Its own module because both the model loader (models.py: which dtype to time, the warning on emulated bf16) and the
weight packer (packing.py, which models.py imports) ask it.
"""

from __future__ import annotations

import torch


def cpu_capabilities() -> dict:
    """What this CPU has (torch.cpu.get_capabilities: instruction sets, "cpu_name"); empty where torch is too old
    to say."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    return dict(capabilities()) if capabilities is not None else {}


def native_matmuls(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` multiplies `dtype` matrices in hardware. A CPU without bf16 (fp16) instructions has torch
    emulate them, several times slower than float32: a full prefill of 1k tokens took 14.3 s in bfloat16 against
    3.0 s in float32 on an AVX2-only AMD EPYC. GPUs, and a torch too old to say, count as native."""
    have = cpu_capabilities()
    if dtype == torch.float32 or device.type != "cpu" or not have:
        return True
    names = {torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),  # x86, then ARM
             torch.float16: ("avx512_fp16", "amx_fp16", "fp16_arith")}.get(dtype, ())
    return any(have.get(name) for name in names)
