"""Linear weights packed once for the CPU's bf16 kernel, instead of on every call.

On the CPU, `F.linear` in bf16 hands each weight to oneDNN, which first copies it into the blocked layout its
kernel reads, on every call: the weights cross memory three times instead of once. A full prefill (a thousand rows
per matmul) hardly notices; what reuse computes does (a question's few dozen tokens, a repair's shrinking sets,
one token per decode step): the bundled model's 210 decoder linears read 212 MB of bf16 weights per forward.
Packing each weight once, when the engine takes the model, and calling oneDNN's linear on the packed copy gives the
same numbers bit for bit (`tests/unit/test_packing.py`) at a lower cost; the figures are in docs/method.md ("Packed
weights and a decode step's attention").

torch's own ops for this (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`) are what its compiler
emits for frozen CPU models; we call them directly rather than compile the model (minutes on two cores, and a
recompile per new shape). They are not public API, so a probe checks them on each model before any layer is
swapped, and anything unexpected leaves the model as it was. fp32 is left alone: MKL's packed sgemm serves only
the row count it was packed for, and the repair's row counts change at every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Packing keeps a second copy of every linear weight (the original stays: state dicts, weight digests and
# Phi-3's fused projection read it). Past this many bytes of linear weights the copy costs more memory than a
# CPU user would expect to give to a few milliseconds per forward.
MAX_PACKED_BYTES = 4 << 30


class PackedLinear(torch.nn.Module):
    """An nn.Linear whose forward runs on a weight packed once. Holds the same weight and bias Parameters, so
    the model's state dict, tied weights and anything reading `.weight` see no change."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = packed  # oneDNN's blocked layout, not a Parameter: never saved, never moved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        if self.weight.device.type != "cpu" or self.weight.dtype != self.packed.dtype:
            # The model was moved or cast since it was packed (.to("cuda"), .float()): the weight went with it.
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` are packed: bf16 on a CPU whose oneDNN runs bf16, where the probe
    (a packed linear against F.linear, bit for bit) passes."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        weight, bias = torch.randn(48, 40, dtype=dtype), torch.randn(48, dtype=dtype)
        x = torch.randn(2, 3, 40, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
                                F.linear(x, weight, bias)))
    except (RuntimeError, AttributeError):  # an op missing or refused by this build of torch
        return False


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every nn.Linear of `model` for a PackedLinear where `can_pack` says so; returns how many were swapped
    (0: the model is left as it was)."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    if not linears:
        return 0
    weight = linears[0][2].weight
    size = sum(child.weight.numel() * child.weight.element_size() for _, _, child in linears)
    mixed = any(child.weight.dtype != weight.dtype or child.weight.device != weight.device for _, _, child in linears)
    if mixed or size > MAX_PACKED_BYTES or not can_pack(weight.dtype, weight.device):  # the probe last: it computes
        return 0
    packed: dict[int, torch.Tensor] = {}  # one packed copy per weight, however many modules share it
    with torch.no_grad():
        for parent, name, child in linears:
            key = id(child.weight)
            if key not in packed:
                packed[key] = torch.ops.mkldnn._reorder_linear_weight(child.weight.detach(), None)
            setattr(parent, name, PackedLinear(child, packed[key]))
    return len(linears)
