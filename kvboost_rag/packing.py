"""Linear weights laid out once for the CPU's kernels: packed for bf16, transposed for float32 at a few rows.

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
swapped, and anything unexpected leaves the model as it was. MKL's packed sgemm serves only the
row count it was packed for, and the repair's row counts change at every layer, so float32 is not packed. It is
transposed instead (`ColumnsLinear`): `F.linear` multiplies by the weight as stored, [out, in], read transposed, and
MKL's sgemm takes another path for that from four rows on, which costs 2-9x more up to ~32 rows (bundled model,
Intel Xeon: a 576 x 576 projection 38 us at 3 rows, 346 us at 4, 41 us from the weight stored [in, out]): the row
counts of a batch of concurrent decode steps, or of a step with drafts. A second copy of each weight, [in, out],
serves four rows and more; fewer keep the plain one, which is the faster there (docs/method.md, "Float32 weights
stored twice"). From ~64 rows (prefills, repairs) the two paths cost the same and give the same numbers.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time

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


# ColumnsLinear's transposed copy serves inputs of this many rows and more: below it MKL's path for the weight as
# stored is the faster one (3 rows: 60.5 ms a forward of the bundled model against 72.2 transposed).
COLUMN_ROWS = 4


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


class ColumnsLinear(torch.nn.Linear):
    """A float32 nn.Linear that also keeps its weight transposed, [in, out]: inputs of COLUMN_ROWS rows and more are
    multiplied by that copy, fewer by the weight as stored. The same numbers up to float32 rounding (another kernel's
    order of sums), and each row count always takes the same path."""

    columns: torch.Tensor  # [in_features, out_features], contiguous; not a Parameter: never saved, never moved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        columns = self.columns
        if (x.numel() >= COLUMN_ROWS * self.in_features and columns.dtype == self.weight.dtype
                and columns.device == self.weight.device):  # else moved or cast since: the weight went with it
            return F.linear(x, columns.t(), self.bias)
        return F.linear(x, self.weight, self.bias)


def packed_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The packed weights of `model`'s PackedLinears and their Siblings (oneDNN's opaque tensors, which
    `copy.deepcopy` cannot copy) and its ColumnsLinears' transposed copies (which a copy in another dtype would not
    use): models.in_dtype shares them instead."""
    found = []
    for module in model.modules():
        if isinstance(module, PackedLinear):
            found += [t for t in (module.packed, module.siblings and module.siblings.packed) if t is not None]
        elif isinstance(module, ColumnsLinear):
            found.append(module.columns)
    return found


@functools.cache
def columns_pay(device: torch.device) -> bool:
    """Whether float32 linears on `device` are faster from a transposed copy at a few rows: the CPU only, where a
    probe finds it (MKL's paths are measured, not assumed: another CPU or BLAS may have none of this). The probe:
    an MLP-sized linear over 8 rows both ways, alternating, medians of 9; the copy must take under 0.8 of the time
    (0.55-0.6 on the Intel Xeon this was found on), so that a noisy machine does not decide it one run and not the
    next."""
    if device.type != "cpu":
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=generator)
    columns, x = weight.t().contiguous(), torch.randn(8, 576, generator=generator)
    if not torch.allclose(F.linear(x, weight), F.linear(x, columns.t()), rtol=1e-4, atol=1e-4):
        return False
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(9):
        for side, w in enumerate((weight, columns.t())):
            started = time.perf_counter()
            for _ in range(5):
                F.linear(x, w)
            times[side].append(time.perf_counter() - started)
    return statistics.median(times[1]) < 0.8 * statistics.median(times[0])


def column_linears(model: torch.nn.Module) -> int:
    """Give every float32 nn.Linear of `model` on a CPU where `columns_pay` a transposed copy of its weight
    (ColumnsLinear); returns how many (0: the model is left as it was). One copy per weight, however many modules
    share it (a tied LM head); none past MAX_PACKED_BYTES of weights."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears:
        return 0
    weight = linears[0].weight
    unique = {id(m.weight): m.weight for m in linears}
    size = sum(w.numel() * w.element_size() for w in unique.values())
    mixed = any(w.dtype != torch.float32 or w.device != weight.device for w in unique.values())
    if mixed or size > MAX_PACKED_BYTES or not columns_pay(weight.device):  # the probe last: it computes
        return 0
    with torch.no_grad():
        copies = {key: w.detach().t().contiguous() for key, w in unique.items()}
        for module in linears:
            module.__class__ = ColumnsLinear  # the same module and weights, a forward that picks the layout
            module.columns = copies[id(module.weight)]
    return len(linears)


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
