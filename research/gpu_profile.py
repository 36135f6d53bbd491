"""Where a cacheblend prefill's time goes on a GPU: one warm prefill of each kind under torch.profiler, CPU time
against device time, and every wait of the host on the device counted and traced to its line.

One prompt of about TOKENS tokens, built as `kvboost-rag bench-scaling` builds them (the bundled synthetic set, its
documents ingested and calibrated as a user's are), on the bundled model with default settings (EngineConfig's,
fidelity `balanced`, the guard's ladder and its step costs on). Three prefills, side by side:

- `full`: a full prefill;
- `cacheblend`: the default, as a request is served: its repair, the guard's first-token judgment, and the
  ladder's steps when the guard refuses it (escalation at a larger budget, then a full prefill);
- `cacheblend fast`: the repair alone (`fidelity="fast"`: the guard measures, never acts).

Each is warmed up WARMUP times, timed ROUNDS times interleaved (medians; the ladder's steps each run took), then
profiled once (CPU and CUDA activity): the wall time against the device's busy time (its kernels and copies
summed), the stages (planning, assembly, each build of the ladder, the repair, the guard's judgments), the top ops
by self CPU and by self device time, and the counts of what makes the host wait for the device
(cudaStreamSynchronize, device-to-host copies, aten::item / _local_scalar_dense, nonzero, unique), with the op each
sync call was made in. Then each runs once more, unprofiled, under a dispatch mode (HostWaits) that traces every op
that makes the host wait to the line of kvboost_rag that called it. The ladder's step costs (repair/routes.py) need
8 judgments before they skip a step, so the few runs here are all served as a new engine's first requests are.

All of that is warm: the prompt's shapes have run before. With `--cold N`, 2N fresh prompts of the same size follow,
each prefilled twice (full, then cacheblend fast; cold, then warm), alternately with torch's own choice of attention
kernel (cuDNN's on Hopper) and as the adapter runs CUDA attention, without cuDNN's (architectures.CUDA_WITHOUT_CUDNN):
what a prompt's first prefill costs, and what of it is attention set up anew for its shapes (docs/gpu_h200/).

    python3 research/gpu_profile.py --out $OUT/profile.txt                        # on the GPU: ~4k tokens, bf16
    python3 research/gpu_profile.py --cold 3 --out $OUT/profile.txt               # and 6 fresh prompts, cold/warm
    .venv/bin/python research/gpu_profile.py --device cpu --tokens 512 --cold 1   # a dry run on the CPU
"""

import argparse
import collections
import functools
import linecache
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kvboost_rag import EngineConfig, KVBoost, RepairConfig, architectures
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import read_stored, render_prompt, store_shared_prefix
from kvboost_rag.bench.scaling import build_prompts, ingest, token_counter
from kvboost_rag.repair import cacheblend, guard

BUNDLED_SET = Path(__file__).resolve().parents[1] / "kvboost_rag" / "bench" / "synthetic_k8.jsonl"
WARMUP, ROUNDS, TOP = 2, 3, 15
# What makes the host wait for the device: runtime calls that block, and the ops that read a device value back.
SYNC_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
            "aten::_unique", "aten::masked_select", "aten::is_nonzero")
COUNTED = (*SYNC_RUNTIME, "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", *SYNC_OPS,
           "aten::copy_", "aten::to", "aten::topk", "aten::isin", "aten::index", "aten::index_copy_")
STAGE = "stage: "


def staged(label: str, fn):
    """`fn` under a profiler label (its events then show the stage's wall time, waits included)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        name = label(*args, **kwargs) if callable(label) else label
        with record_function(STAGE + name):
            return fn(*args, **kwargs)

    return wrapped


def label_stages() -> None:
    """Profiler labels around the engine's stages, set on the classes and modules from outside (no package edit)."""
    KVBoost.plan = staged("plan (render, tokenize, look up)", KVBoost.plan)
    guard.assemble = staged("assemble (copy stored chunks)", guard.assemble)
    guard.Builder.repaired = staged(lambda self, budget=None, answer=(): f"build: {self.strategy.name}" + (
        f" at budget {self.settings.budget if budget is None else budget:g}" if self.strategy.guarded else ""),
        guard.Builder.repaired)
    guard.Builder.exact = staged("build: full prefill", guard.Builder.exact)
    guard.Watch._judge = staged("guard: judge a first token", guard.Watch._judge)
    guard.exact_cache = staged("full prefill (exact_cache)", guard.exact_cache)
    cacheblend.cacheblend_prefill = staged("cacheblend_prefill (the repair's layers)", cacheblend.cacheblend_prefill)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ladder(pre) -> str:
    """The steps that served the first token: step@budget, in order."""
    return " > ".join(f"{s.step}@{s.budget:g}" if s.budget is not None else s.step for s in pre.served)


def device_work(events) -> list[tuple[str, float]]:
    """The device's own work (kernels, copies, memsets) as (name, µs): its events, else the kernels the profiler
    attached to the ops that launched them; not the spans a record_function label also gets on the device."""
    own = [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    work = own or [(k.name, k.duration) for e in events for k in e.kernels]
    return [(name, us) for name, us in work if not name.startswith(STAGE)]  # a label's device span is no work


def counts_table(events) -> list[str]:
    counted = collections.Counter(e.name for e in events if e.name in COUNTED)
    time_in = collections.Counter()
    for e in events:
        if e.name in COUNTED:
            time_in[e.name] += e.cpu_time_total / 1e3
    copies = collections.Counter(name for name, _ in device_work(events) if name.startswith("Memcpy"))
    lines = [f"  {'event':<34} {'count':>7} {'CPU ms (total)':>15}"]
    lines += [f"  {name:<34} {counted[name]:>7} {time_in[name]:>15.2f}" for name in COUNTED if counted[name]]
    lines += [f"  {name:<34} {n:>7}   (device copies)" for name, n in copies.most_common()]
    return lines


def summarize(name: str, prof, wall_ms: float) -> list[str]:
    events = prof.events()
    busy = sum(us for _, us in device_work(events)) / 1e3  # kernels and copies: one stream here
    waits = sum(e.cpu_time_total for e in events if e.name in SYNC_RUNTIME) / 1e3
    stages = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.name.startswith(STAGE) and e.device_type == torch.autograd.DeviceType.CPU:
            stages[e.name[len(STAGE):]][0] += 1
            stages[e.name[len(STAGE):]][1] += e.cpu_time_total / 1e3
    out = [f"### {name}: wall {wall_ms:.1f} ms (profiled), device busy {busy:.1f} ms, host blocked in sync calls "
           f"{waits:.1f} ms", "", "stages (wall time, waits included; nested stages are inside their parents):"]
    out += [f"  {n:>3} x {ms:9.2f} ms  {stage}" for stage, (n, ms) in stages.items()]
    out += ["", "host-device waits and launches:", *counts_table(events)]
    parents = collections.Counter(enclosing_op(e) for e in events if e.name in SYNC_RUNTIME)
    if parents:
        out += ["  the sync calls, by the op they were made in: " + ", ".join(f"{op} {n}" for op, n in
                                                                          parents.most_common())]
    out += [""]
    averages = prof.key_averages()
    out += [f"top {TOP} ops by self CPU time:",
            averages.table(sort_by="self_cpu_time_total", row_limit=TOP, max_name_column_width=60)]
    if busy:
        out += [f"top {TOP} ops by self device time:",
                averages.table(sort_by="self_device_time_total", row_limit=TOP, max_name_column_width=60)]
    return out


def enclosing_op(event) -> str:
    """The aten op a runtime call (cudaStreamSynchronize...) was made in."""
    seen = event.cpu_parent
    while seen is not None and not seen.name.startswith("aten::"):
        seen = seen.cpu_parent
    return "(no aten op)" if seen is None else seen.name


class HostWaits(TorchDispatchMode):
    """Every op that makes the host wait for the device on a GPU, with the innermost line of kvboost_rag that
    called it: a value read back (item, int(), float()), an op whose output size depends on the data (nonzero,
    unique, boolean indexing, isin's sorting path), a copy between host and device (without non_blocking, torch
    waits for it), a host tensor handed to a device op (copied in first, then waited for). Each kind names the
    device of the op's first tensor: those on host tensors ([cpu]) wait for nothing, and on a CPU run all are."""

    SIZED = {"nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}

    def __init__(self):
        super().__init__()
        self.hits: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = self.kind(func.overloadpacket.__name__, args, kwargs, out)
        if kind:
            self.hits[kind, caller()] += 1
        return out

    def kind(self, name: str, args, kwargs, out) -> str | None:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        where = f" [{tensors[0].device.type}]" if tensors else ""
        if name in ("item", "_local_scalar_dense"):
            return "read a value (item, int, float)" + where
        if name in self.SIZED:
            return f"output sized by the data ({name})" + where
        if name == "isin":
            return "isin (sorting path: _unique, sized by the data)" + where
        if name == "index" and any(t.dtype == torch.bool for t in tensors[1:]):
            return "boolean index (nonzero)" + where
        if name in ("to", "_to_copy", "copy_"):
            source, target = (tensors[1], tensors[0]) if name == "copy_" else (tensors[0], out)
            at = {"to": 3, "copy_": 2}.get(name)  # non_blocking, when given by position
            blocking = not (kwargs.get("non_blocking") or (at is not None and len(args) > at and args[at] is True))
            if isinstance(target, torch.Tensor) and source.device != target.device and blocking:
                return f"copy {source.device.type} -> {target.device.type}"
            return None
        if len({t.device.type for t in tensors if t.dim() > 0}) > 1:
            return f"host tensor into a device op ({name}): copied in"
        return None

    @staticmethod
    def waits(kind: str) -> bool:
        """Whether an op of `kind` makes the host wait on a GPU: not one on host tensors."""
        return not kind.endswith("[cpu]")


def caller(root: str = "kvboost_rag") -> str:
    """The innermost frame of the package on the Python stack: file:line function: the line's text."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if f"/{root}/" in path:
            text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return f"{path[path.rfind(root):]}:{frame.f_lineno} {frame.f_code.co_name}: {text}"
        frame = frame.f_back
    return "(outside kvboost_rag)"


def waits_table(hits: collections.Counter) -> list[str]:
    kinds = collections.Counter()
    for (kind, _), n in hits.items():
        kinds[kind] += n
    waits = sum(n for kind, n in kinds.items() if HostWaits.waits(kind))
    lines = [f"  {waits} ops that wait for the device, {sum(kinds.values()) - waits} more on host tensors (no wait): "
             + ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()), ""]
    lines += [f"  {n:>5}  {kind:<56}  {where}" for (kind, where), n in hits.most_common()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=4000, help="the prompt's size in tokens (default 4000)")
    parser.add_argument("--data", type=Path, default=BUNDLED_SET)
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    parser.add_argument("--cold", type=int, default=0,
                        help="then 2N fresh prompts of the same size, each prefilled once cold (its shapes new to the "
                             "kernels) and once warm, full and cacheblend fast: N with torch's own choice of "
                             "attention kernel, N without cuDNN's, alternately (default 0: none)")
    args = parser.parse_args()

    report: list[str] = []

    def say(*lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            report.append(line)

    engine = KVBoost.from_pretrained(config=EngineConfig(dtype=args.dtype, device=args.device))
    device = engine.adapter.device
    label_stages()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    say(f"# gpu_profile: {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), {args.dtype}, "
        f"{engine.model_id}", f"command: {' '.join(sys.argv)}", "")
    specs = build_prompts(load_items(args.data), [args.tokens], 1 + 2 * args.cold, token_counter(engine))
    prompt_spec = specs[0]
    documents = list(dict.fromkeys(d for spec in specs for d in spec.item.documents))
    ingestion = ingest(engine, documents, progress=False)
    read_stored(engine, [spec.item for spec in specs])
    store_shared_prefix(engine, prompt_spec.item)
    prompt = render_prompt(prompt_spec.item)
    say(f"prompt: {prompt_spec.tokens} tokens, {len(prompt_spec.item.documents)} documents; ingestion ({len(specs)} "
        f"prompt(s)) {ingestion}", "")

    kinds = {"full": ("full", None), "cacheblend": ("cacheblend", None),
             "cacheblend fast": ("cacheblend", RepairConfig(fidelity="fast"))}

    def run(kind: str, messages=prompt):
        strategy, repair = kinds[kind]
        sync(device)
        started = time.perf_counter()
        pre = engine.prefill(messages, strategy, write_back=False, repair=repair)
        sync(device)
        return pre, (time.perf_counter() - started) * 1e3

    for _ in range(WARMUP):
        for kind in kinds:
            run(kind)
    timings = collections.defaultdict(list)
    for round_ in range(ROUNDS):
        for kind in list(kinds)[round_ % len(kinds):] + list(kinds)[:round_ % len(kinds)]:
            pre, ms = run(kind)
            timings[kind].append((pre.ttft_ms, ms, ladder(pre), pre.recomputed_tokens))
    say(f"## TTFT, {ROUNDS} rounds interleaved after {WARMUP} warm-ups (median; per run: TTFT ms, ladder, "
        "recomputed tokens)")
    for kind, runs in timings.items():
        median = statistics.median(t for t, _, _, _ in runs)
        say(f"  {kind:<16} {median:8.1f} ms   " + "; ".join(f"{t:.1f} {steps} ({r})" for t, _, steps, r in runs))
    say(f"  routes: {dict(engine.routes.counters)}", "")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    say("## One warm prefill of each under torch.profiler", "")
    for kind in kinds:
        with profile(activities=activities) as prof:
            pre, wall = run(kind)
        say(f"(ladder: {ladder(pre)}, recomputed tokens {pre.recomputed_tokens}, TTFT {pre.ttft_ms:.1f} ms)")
        say(*summarize(kind, prof, wall), "")

    say("## The host's waits per prefill, by the line of kvboost_rag that asked (a dispatch mode, unprofiled)", "")
    for kind in kinds:
        with HostWaits() as waits:
            pre, wall = run(kind)
        say(f"### {kind}: ladder {ladder(pre)}, wall {wall:.1f} ms (the mode slows it)", *waits_table(waits.hits), "")

    if args.cold:
        # `cacheblend fast`: the default's repair would soon be skipped by the ladder's step costs (routes.py).
        say("## Fresh prompts: TTFT cold (the prompt's first prefill) -> warm (its second), ms", "")
        for i, spec in enumerate(specs[1:]):
            cudnn = i % 2 == 0
            architectures.CUDA_WITHOUT_CUDNN = not cudnn
            messages, times = render_prompt(spec.item), collections.defaultdict(list)
            for _ in ("cold", "warm"):
                for kind in ("full", "cacheblend fast"):
                    times[kind].append(run(kind, messages)[0].ttft_ms)
            say(f"  {spec.item.id} ({spec.tokens} tokens), cuDNN attention {'allowed' if cudnn else 'left out'}: "
                + ", ".join(f"{kind} {cold:.1f} -> {warm:.1f}" for kind, (cold, warm) in times.items()))
        architectures.CUDA_WITHOUT_CUDNN = True
        say("")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
