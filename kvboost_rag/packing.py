"""Linear weights packed once for the CPU's bf16 kernel, instead of on every call.

On the CPU, `F.linear` in bf16 hands each weight to oneDNN, which first copies it into the blocked layout its
kernel reads, on every call: the weights cross memory three times instead of once. A full prefill (a thousand rows
per matmul) hardly notices; what reuse computes does (a question's few dozen tokens, a repair's shrinking sets,
one token per decode step): the bundled model's 210 decoder linears read 212 MB of bf16 weights per forward.
Packing each weight once, when the engine takes the model, and calling oneDNN's linear on the packed copy gives the
same numbers bit for bit (`tests/unit/test_packing.py`) at a lower cost; the figures are in docs/method.md ("Packed
weights and a decode step's attention"). Linears that read one input (q/k/v, gate/up) then run as one call over
their weights side by side (`Siblings`, note 1g there): 4 calls per layer instead of 7, the same numbers again.

torch's own ops for this (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`) are what its compiler
emits for frozen CPU models; we call them directly rather than compile the model (minutes on two cores, and a
recompile per new shape). They are not public API, so a probe checks them on each model before any layer is
swapped, and anything unexpected leaves the model as it was. fp32 is left alone: MKL's packed sgemm serves only
the row count it was packed for, and the repair's row counts change at every layer.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .hardware import native_matmuls

# Packing keeps a second copy of every linear weight (the original stays: state dicts, weight digests and
# Phi-3's fused projection read it), and k and v a third (see Siblings). Past this many bytes of linear weights
# the copies cost more memory than a CPU user would expect to give to a few milliseconds per forward.
MAX_PACKED_BYTES = 4 << 30
# Siblings that read one input, in the order the layers call them: the first computes all of them in one call.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Siblings also called alone, on an input of their own (adapter.project_kv): they keep their own packed weight.
CALLED_ALONE = ("k_proj", "v_proj")


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a packed weight: x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class PackedLinear(torch.nn.Module):
    """An nn.Linear whose forward runs on a weight packed once. Holds the same weight and bias Parameters, so
    the model's state dict, tied weights and anything reading `.weight` see no change."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # oneDNN's blocked layout, not a Parameter: never saved, never moved. None for a sibling that needs none.
        self.packed = packed
        self.siblings: Siblings | None = None  # set when it is computed with the linears beside it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        if self.weight.device.type != "cpu" or self.weight.dtype != self.weight_dtype:
            # The model was moved or cast since it was packed (.to("cuda"), .float()): the weight went with it.
            return F.linear(x, self.weight, self.bias)
        if self.siblings is not None:
            return self.siblings.columns_of(self, x)
        return _linear(x, self.packed, self.bias)

    @property
    def weight_dtype(self) -> torch.dtype:
        return (self.packed if self.packed is not None else self.siblings.packed).dtype

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class Siblings:
    """Linears that read the same input (an attention's q, k, v projections; an MLP's gate and up) computed as one
    oneDNN call over their weights side by side, each served its columns of the result.

    With few rows a linear's cost is mostly per call and per weight read, not arithmetic: for 30 rows the three
    projections took 166 us apart and 104 together, for one row (a decode step) 72 and 31. The columns are the same
    numbers bit for bit (`fits` checks it on the model's own weights before any is fused).

    The layers call the siblings one after another on the same tensor, unchanged: the first computes all of them
    and keeps the result until each sibling has taken its columns. A sibling called on another input runs on its
    own packed weight if it kept one (CALLED_ALONE: cacheblend's `project_kv` reads k and v alone), else computes
    all the columns again and serves its own. Not thread-safe, as the model's forward is not: the engine runs one
    forward at a time."""

    def __init__(self, members: list[PackedLinear]):
        self.members = members
        self.packed = _pack(torch.cat([member.weight for member in members]))
        self.bias = None if members[0].bias is None else torch.cat([member.bias.detach() for member in members])
        ends = itertools.accumulate(member.out_features for member in members)
        self.columns = {member: (end - member.out_features, end) for member, end in zip(members, ends, strict=True)}
        self.input: torch.Tensor | None = None
        self.result: torch.Tensor | None = None
        self.waiting: set[PackedLinear] = set()  # the members that have not yet taken their columns of `result`

    def columns_of(self, member: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> member's output [..., member.out_features] (a view of the group's)."""
        if x is not self.input or member not in self.waiting:
            if member.packed is not None:
                return _linear(x, member.packed, member.bias)
            self.input, self.waiting = x, set(self.members)
            self.result = _linear(x, self.packed, self.bias)
        start, end = self.columns[member]
        out = self.result[..., start:end]
        self.waiting.discard(member)
        if not self.waiting:  # every member served: nothing kept alive past this layer
            self.input = self.result = None
        return out

    def fits(self) -> bool:
        """Whether each member's columns equal its own linear's output bit for bit, for a decode step's row and
        a few rows (oneDNN could block a wider weight otherwise)."""
        generator = torch.Generator().manual_seed(0)  # the caller's random state is left alone
        for rows in (1, 17):
            x = torch.randn(1, rows, self.members[0].in_features, generator=generator).to(self.packed.dtype)
            together = _linear(x, self.packed, self.bias)
            for member in self.members:
                start, end = self.columns[member]
                alone = F.linear(x, member.weight, member.bias)
                if not torch.equal(together[..., start:end], alone):
                    return False
        return True


def packed_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The packed weights of `model`'s PackedLinears and their Siblings: oneDNN's opaque tensors, which
    `copy.deepcopy` cannot copy (models.in_dtype shares them instead)."""
    found = []
    for module in model.modules():
        if isinstance(module, PackedLinear):
            found += [t for t in (module.packed, module.siblings and module.siblings.packed) if t is not None]
    return found


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` are packed: bf16 on a CPU with bf16 instructions whose oneDNN runs
    bf16, where the probe (a packed linear against F.linear, bit for bit) passes. A CPU without them (an Intel Xeon
    with AVX-512 but no avx512_bf16) has oneDNN emulate bf16 on both paths, which then round apart: the probe's
    small shapes agree there, a 64 x 49152 LM head does not; and emulated bf16 is never the fast path anyway."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    if not native_matmuls(dtype, device):
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        weight, bias = torch.randn(48, 40, dtype=dtype), torch.randn(48, dtype=dtype)
        x = torch.randn(2, 3, 40, dtype=dtype)
        return bool(torch.equal(_linear(x, _pack(weight), bias), F.linear(x, weight, bias)))
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
    with torch.no_grad():
        swapped = []
        for parent, name, child in linears:
            swapped.append((name, PackedLinear(child)))
            setattr(parent, name, swapped[-1][1])
        fuse_siblings(model)  # before packing: a sibling served by its group's weight needs none of its own
        packed: dict[int, torch.Tensor] = {}  # one packed copy per weight, however many modules share it
        for name, linear in swapped:
            if linear.siblings is None or name in CALLED_ALONE:
                key = id(linear.weight)
                if key not in packed:
                    packed[key] = _pack(linear.weight)
                linear.packed = packed[key]
    return len(linears)


def fuse_siblings(model: torch.nn.Module) -> int:
    """Group each module's FUSED_SIBLINGS (all PackedLinear, one input width, all with biases or none) into
    Siblings, where their columns come out bit for bit; returns how many groups were made. The members' own
    weights are packed after (pack_linears): only those not grouped, and CALLED_ALONE."""
    groups = 0
    for parent in model.modules():
        for names in FUSED_SIBLINGS:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is PackedLinear and m.siblings is None for m in members):
                continue
            if len({m.in_features for m in members}) > 1 or len({m.bias is None for m in members}) > 1:
                continue
            siblings = Siblings(members)
            if not siblings.fits():
                continue
            for member in members:
                member.siblings = siblings
            groups += 1
    return groups
