"""Compile kvflow's real kernel launches for a GPU that is not here, and report their shared
memory: a Triton kernel whose pipelined tiles need more shared memory than the GPU gives a
block fails at its first launch (OutOfResources), so a tile picked on an H100 (227 KB) can
break every decode step on an L40S or an A10 (99 KB).

Run as a script (the test suite interprets kernels instead: TRITON_INTERPRET must be unset):

    python3 -m tests.kernels.target_compile 86 89   # one JSON line per launch attempt
    python3 -m tests.kernels.target_compile --registers 90   # and each one's ptxas report

`--registers` adds what ptxas says of each launch's code: registers a thread, bytes spilled,
and whether it serialized the warpgroup MMAs (warning C7515, which costs a Hopper kernel its
MMA pipelining), so a kernel can be read without the GPU it is for.

The launchers run on CPU tensors with `JITFunction.run` replaced: each launch is specialised
and compiled as Triton's own launch path does (`create_function_from_signature`,
`_pack_args`), for the named compute capability (Triton's bundled ptxas; no GPU, no driver),
and raises OutOfResources where it would not fit that GPU, as a real launch does; so the
launchers' own retries with fewer stages (kernels/triton_stages.py) run as they would there.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run with TRITON_INTERPRET unset: interpreted kernels have no compile")

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, compile, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import (
    JITFunction,
    create_function_from_signature,
    serialize_specialization_data,
)

from kernels import gluon_hopper, gluon_int4
from kernels.fp8 import FP8
from kernels.int4 import Int4Stack
from kernels.moe import ClampedSwiglu, ExpertBiases
from kernels.triton_decode_attention import paged_decode_attention
from kernels.triton_fp8 import fp8_skinny_linear
from kernels.triton_int4 import int4_linear
from kernels.triton_linear import skinny_linear
from kernels.triton_moe import moe_experts
from kernels.triton_moe_int4 import moe_experts_int4, moe_experts_int4_grouped
from kernels.triton_moe_tiles import GROUPED_TILES, GROUPED_TILES_FP8
from kernels.triton_prefill_attention import paged_prefill_attention

Launch = tuple[JITFunction, tuple[Any, ...], dict[str, Any]]
# Shared memory a block may take (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN):
SHARED_LIMITS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}  # A100; A10; L40S; H100


@contextmanager
def launches_on(capability: int) -> Iterator[list[dict[str, Any]]]:
    """Within it, every Triton kernel launch is compiled for `capability`, not run: one that
    needs more shared memory than such a GPU has raises OutOfResources, as at a real launch.
    Yields the attempts: kernel, constants, shared bytes, and whether they fit."""
    from kernels import triton_decode_attention, triton_stages

    triton_stages._stages_that_fit.clear()  # counts that fit another GPU do not carry over
    attempts: list[dict[str, Any]] = []
    original = JITFunction.run
    # Kernels launch with PDL (and the GEMV's L2 prefetch) from Hopper on, as on such a GPU.
    pdl = {name: module for name, module in sys.modules.items()
           if name.startswith("kernels.") and hasattr(module, "launches_early")}  # fmt: skip
    saved = {name: module.launches_early for name, module in pdl.items()}
    for module in pdl.values():
        module.launches_early = lambda tensor: capability >= 90
    # An FP8 cache is read as words, converted by inline PTX, from Hopper on, as on such a GPU.
    reads_words = triton_decode_attention.reads_e4m3_words_on
    triton_decode_attention.reads_e4m3_words_on = lambda tensor: capability >= 90
    # The Gluon int4 kernel runs on Hopper alone (kernels/gluon_int4.py): an H100's 132 SMs.
    gluon_runs_on, gluon_sm_count = gluon_int4.runs_on, gluon_int4._sm_count
    gluon_int4.runs_on = lambda tensor: capability == 90 and gluon_hopper.available()
    gluon_int4._sm_count = lambda index: 132

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kw: Any) -> None:
        if "INTERPRETED" in kw:  # the launchers' CPU-tensor path: compile the GPU one
            kw["INTERPRETED"] = False
        shared, report = _compiled((self, args, kw), capability)
        fits = shared <= SHARED_LIMITS[capability]
        attempts.append(
            {"launch": describe((self, args, kw)), "shared": shared, "fits": fits, **report}
        )
        if not fits:
            raise OutOfResources(shared, SHARED_LIMITS[capability], "shared memory")

    JITFunction.run = compile_only  # type: ignore[method-assign]
    try:
        yield attempts
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
        for name, module in pdl.items():
            module.launches_early = saved[name]
        triton_decode_attention.reads_e4m3_words_on = reads_words
        gluon_int4.runs_on, gluon_int4._sm_count = gluon_runs_on, gluon_sm_count


REPORT_REGISTERS = False  # main's --registers: run ptxas -v on each launch's code


@functools.cache
def _compiled_shared(
    kernel: JITFunction, label: str, capability: int, call: _Call
) -> tuple[int, tuple[tuple[str, object], ...]]:
    del label  # part of the cache key only
    args, kwargs = call.args, call.kwargs
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    _hook_serializes(kernel, signature, constexprs, attrs, options, target)
    gluon = getattr(kernel, "is_gluon", lambda: False)()
    source = (GluonASTSource if gluon else ASTSource)(kernel, signature, constexprs, attrs)
    compiled = compile(source, target=target, options=options.__dict__)
    report = ptxas_report(compiled.asm["ptx"], capability) if REPORT_REGISTERS else {}
    return int(compiled.metadata.shared), tuple(report.items())


def _hook_serializes(
    kernel: JITFunction, signature: Any, constexprs: Any, attrs: Any, options: Any, target: Any
) -> None:
    """Where a jit cache hook is set (the engine's watch of late compiles), Triton writes each
    new variant's arguments as JSON before compiling it: a constant JSON cannot write (a Gluon
    layout passed as an argument, on 2026-12-06) fails that launch in the engine, not in the
    kernel's own tests. Raises as that launch would."""
    extra = (
        [target] if "target" in inspect.signature(serialize_specialization_data).parameters else []
    )
    serialize_specialization_data(
        kernel.fn.__qualname__, signature, constexprs, attrs, options, ("key",), *extra
    )


def ptxas_report(ptx: str, capability: int) -> dict[str, object]:
    """Triton's bundled ptxas -v on the code: registers a thread, bytes spilled, and whether
    the warpgroup MMAs were serialized (C7515)."""
    ptxas = get_ptxas(capability).path  # the one Triton compiled the launch with
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as file:
            file.write(ptx)
        done = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", path + ".cubin"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    said = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", said)
    spilled = re.search(r"(\d+) bytes spill stores", said)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spilled.group(1)) if spilled else 0,
        "mma_serialized": "C7515" in said,
    }


def _compiled(launch: Launch, capability: int) -> tuple[int, dict[str, object]]:
    kernel, args, kwargs = launch
    label = describe(launch)
    shared, report = _compiled_shared(kernel, label, capability, _Call(label, args, kwargs))
    return shared, dict(report)


class _Call:
    """A launch's arguments, hashed by its description (kernel, constants, warps, stages,
    argument dtypes): launches alike in those compile alike here, whatever their sizes."""

    def __init__(self, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.label, self.args, self.kwargs = label, args, kwargs

    def __hash__(self) -> int:
        return hash(self.label)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Call) and other.label == self.label


def shared_bytes(launch: Launch, capability: int) -> int:
    """The shared memory a block of this launch takes on a GPU of `capability` (e.g. 86),
    compiled as Triton's launch path compiles it."""
    return _compiled(launch, capability)[0]


def describe(launch: Launch) -> str:
    """The kernel and its compile-time choices (constants, warps, stages, argument dtypes)."""
    kernel, args, kwargs = launch
    shown = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
    dtypes = sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor)})
    return f"{kernel.fn.__name__} {shown} {dtypes}"


# -- The launches to check: each decode/prefill kernel at the default tiles of 8B shapes ------

LLAMA_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip


def _skinny_launches(rows: list[int], fp8: bool) -> None:
    for m in rows:
        for n, k in LLAMA_SHAPES.values():
            x = torch.empty(m, k, dtype=torch.bfloat16)
            if fp8:
                weight = torch.empty(n, k, dtype=FP8)
                fp8_skinny_linear(x, weight, torch.empty(n, dtype=torch.float32))
            else:
                skinny_linear(x, torch.empty(n, k, dtype=torch.bfloat16))


def _int4_launches() -> None:
    """The int4 tl.dot kernel at each of its tiles (1, 16 and 32 rows), in bf16 and fp16: its
    inline PTX must assemble for every GPU too."""
    for dtype, rows in ((torch.bfloat16, [1, 16, 32]), (torch.float16, [1])):
        for m in rows:
            for name, (n, k) in LLAMA_SHAPES.items():
                if name != "lm_head":  # int4 checkpoints keep lm_head in 16 bits
                    qweight = torch.empty(n, k // 8, dtype=torch.int32)
                    scales = torch.empty(n, k // 128, dtype=dtype)
                    zeros = torch.empty(n, k // 128, dtype=torch.uint8)
                    int4_linear(torch.empty(m, k, dtype=dtype), qweight, scales, zeros, 128)


def _gluon_int4_launches() -> None:
    """The Gluon int4 kernel (warpgroup MMA) at the rows it takes, 8B shapes, with its default
    tiles and the sweep's extremes: the largest x tile and stages, and one warpgroup."""
    for m, (name, (n, k)) in itertools.product((96, 256, 512), LLAMA_SHAPES.items()):
        if name == "lm_head":
            continue
        x = torch.empty(m, k, dtype=torch.bfloat16)
        qweight = torch.empty(n, k // 8, dtype=torch.int32)
        scales = torch.empty(n, k // 128, dtype=torch.bfloat16)
        zeros = torch.empty(n, k // 128, dtype=torch.uint8)
        gluon_int4.gluon_int4_linear(x, qweight, scales, zeros, 128)
    x = torch.empty(256, 4096, dtype=torch.float16)
    qweight = torch.empty(4096, 512, dtype=torch.int32)
    scales, bias = torch.empty(4096, 32, dtype=torch.float16), torch.empty(4096).half()
    for tiles in (gluon_int4.WgmmaTiles(256, 128, 8, 4, 2), gluon_int4.WgmmaTiles(64, 64, 4, 4, 1)):
        gluon_int4.gluon_int4_linear(x, qweight, scales, None, 128, None, bias, tiles=tiles)


def _attention_launches(kv_dtype: torch.dtype) -> None:
    """Decodes and prompts at each head size, over the whole context and in a sliding window
    (a variant of its own: the window's bounds and masks)."""
    for head_dim, window in itertools.product((64, 128, 256), (None, 128)):
        cache = torch.empty(64, 16, 8, head_dim, dtype=kv_dtype)
        tables = torch.zeros(4, 16, dtype=torch.int32)
        seq_lens = torch.full((4,), 256, dtype=torch.int32)
        for tokens in (4, 1024):  # four decodes; four prompts of 256
            query = torch.empty(tokens, 32, head_dim, dtype=torch.bfloat16)
            starts = torch.arange(5, dtype=torch.int32) * (tokens // 4)
            if tokens == 4:
                paged_decode_attention(query, cache, cache, tables, seq_lens, 0.1, window=window)
            else:
                paged_prefill_attention(
                    query, cache, cache, tables, seq_lens, starts, 256, 256, 0.1, window=window
                )


def _moe_launches(fp8: bool, gpt_oss: bool = False) -> None:
    """Qwen3-30B-A3B's experts at one token (the GEMVs) and at each grouped tile set's most
    pairs (the last at 16,384 tokens), bf16 or FP8 (a scale per row); with gpt-oss's biases
    and clamped SwiGLU."""
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    dtype = FP8 if fp8 else torch.bfloat16
    gate_up = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
    down = torch.empty(experts, hidden, inter, dtype=dtype)
    scales = (torch.ones(experts, 2 * inter, 1), torch.ones(experts, hidden, 1)) if fp8 else ()
    extra = {}
    if gpt_oss:
        biases = ExpertBiases(torch.zeros(experts, 2 * inter), torch.zeros(experts, hidden))
        extra = dict(biases=biases, swiglu=ClampedSwiglu(7.0))
    table = GROUPED_TILES_FP8 if fp8 else GROUPED_TILES
    for pairs in [top_k] + [min(most, 16384 * top_k) for most, _ in table]:
        tokens = pairs // top_k
        ids = torch.arange(pairs).remainder(experts).view(tokens, top_k)
        x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
        moe_experts(x, gate_up, down, torch.ones(tokens, top_k), ids, *scales, **extra)
    # Expert parallelism: another rank's pairs (-1) are left out, and the rows' sum skips them.
    ids = torch.arange(1024).remainder(experts + 1).sub(1).view(-1, top_k)
    x = torch.zeros(len(ids), hidden, dtype=torch.bfloat16)
    moe_experts(x, gate_up, down, torch.ones(ids.shape), ids, *scales, **extra)


def _moe_int4_launches() -> None:
    """Qwen3-30B-A3B's int4 experts (groups of 128, zero points) at one token and at each
    grouped tile set's most pairs, as _moe_launches."""
    experts, hidden, inter, top_k = 128, 2048, 768, 8

    def stack(rows: int, cols: int) -> Int4Stack:
        groups = (experts, rows, cols // 128)
        return Int4Stack(torch.empty(experts, rows, cols // 8, dtype=torch.int32),
                         torch.empty(groups, dtype=torch.bfloat16),
                         torch.empty(groups, dtype=torch.uint8), 128)  # fmt: skip

    gate_up, down = stack(2 * inter, hidden), stack(hidden, inter)
    for pairs in [top_k] + [min(most, 4096 * top_k) for most, _ in GROUPED_TILES]:
        tokens = pairs // top_k
        ids = torch.arange(pairs).remainder(experts).view(tokens, top_k)
        x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
        moe_experts_int4(x, gate_up, down, torch.ones(tokens, top_k), ids)


def _moe_mxfp4_launches() -> None:
    """gpt-oss-20b's MXFP4 experts (32 of 2880 columns over 2880, top 4, biases, clamped
    SwiGLU) at one token and at 4,096: the grouped GEMMs' smallest and largest blocks, and
    the GEMVs (what the launcher takes at one token)."""
    experts, hidden, inter, top_k = 32, 2880, 2880, 4

    def stack(rows: int, cols: int) -> Int4Stack:
        return Int4Stack(torch.empty(experts, rows, cols // 8, dtype=torch.int32),
                         torch.empty(experts, rows, cols // 32, dtype=torch.bfloat16), None, 32,
                         e2m1=True)  # fmt: skip

    gate_up, down = stack(2 * inter, hidden), stack(hidden, inter)
    biases = ExpertBiases(torch.zeros(experts, 2 * inter), torch.zeros(experts, hidden))
    for tokens in (1, 4096):
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
        x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
        weights = torch.ones(tokens, top_k)
        moe_experts_int4(x, gate_up, down, weights, ids, biases, ClampedSwiglu(7.0))  # GEMVs at 1
        moe_experts_int4_grouped(x, gate_up, down, weights, ids, biases=biases,
                                 swiglu=ClampedSwiglu(7.0))  # fmt: skip


# name -> (what launches, the compute capabilities it must fit)
CHECKS: dict[str, tuple[Callable[[], None], tuple[int, ...]]] = {
    # No PDL before Hopper: ops.linear gives the skinny GEMV at most 16 rows there.
    "skinny bf16, 1-16 rows": (lambda: _skinny_launches([1, 4, 16], fp8=False), (80, 86, 89)),
    "skinny bf16, 17-64 rows (Hopper)": (lambda: _skinny_launches([32, 64], fp8=False), (90,)),
    "fp8 gemv": (lambda: _skinny_launches([1, 16, 32, 64], fp8=True), (89, 90)),
    "int4 dot": (_int4_launches, (80, 86, 89, 90)),
    "int4 wgmma (Gluon)": (_gluon_int4_launches, (90,)),
    "attention bf16 cache": (lambda: _attention_launches(torch.bfloat16), (80, 86, 89, 90)),
    "attention fp8 cache": (lambda: _attention_launches(torch.float8_e4m3fn), (89, 90)),
    "moe bf16": (lambda: _moe_launches(fp8=False), (86, 90)),  # the least shared memory, H100
    "moe fp8": (lambda: _moe_launches(fp8=True), (89, 90)),
    "moe int4": (_moe_int4_launches, (80, 86, 90)),
    "moe gpt-oss": (lambda: _moe_launches(fp8=False, gpt_oss=True), (86, 90)),
    "moe mxfp4 gpt-oss": (_moe_mxfp4_launches, (90,)),
}


def main() -> None:
    """One JSON line per launch attempt of each check on each of its GPUs: the kernel, its
    shared memory, whether it fits. Exits non-zero if a launcher fails on a GPU it must run on
    (OutOfResources escaped its retries)."""
    global REPORT_REGISTERS
    REPORT_REGISTERS = "--registers" in sys.argv
    only = {int(c) for c in sys.argv[1:] if c != "--registers"}
    for name, (launch_all, capabilities) in CHECKS.items():
        for capability in capabilities:
            if only and capability not in only:
                continue
            with launches_on(capability) as attempts:
                launch_all()
            for attempt in {a["launch"]: a for a in attempts}.values():
                print(json.dumps({"check": name, "capability": capability, **attempt}), flush=True)


if __name__ == "__main__":
    main()
