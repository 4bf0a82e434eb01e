"""examples/aot_compile.py: bytes per kernel of an optimized GPU/TPU program (the analysis half;
the compile half needs JAX's CUDA plugin or libtpu, which CI does not install)."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "aot_compile.py"

HLO = """HloModule jit_loss

%fused_convert (p0: f32[1024,256]) -> bf16[1024,256] {
  %p0 = f32[1024,256]{1,0} parameter(0)
  ROOT %c = bf16[1024,256]{1,0} convert(%p0)
}

%fused_computation.9 (p0: bf16[1024,512], p1: bf16[512,64]) -> bf16[1024,64] {
  %p0 = bf16[1024,512]{1,0} parameter(0)
  %p1 = bf16[512,64]{1,0} parameter(1)
  ROOT %d = bf16[1024,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.1 (x.1: f32[1024,256], w.1: bf16[256,512], big.1: bf16[64,1000], v.1: bf16[512,64]) -> (f32[], bf16[1024,512]) {
  %x.1 = f32[1024,256]{1,0} parameter(0)
  %w.1 = bf16[256,512]{1,0} parameter(1)
  %big.1 = bf16[64,1000]{1,0} parameter(2)
  %v.1 = bf16[512,64]{1,0} parameter(3)
  %loop_convert_fusion.3 = bf16[1024,256]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_convert
  %gemm_fusion_dot.7 = bf16[1024,512]{1,0} fusion(%loop_convert_fusion.3, %w.1), kind=kCustom, calls=%g
  %bitcast.2 = bf16[512,1024]{0,1} bitcast(%gemm_fusion_dot.7)
  %fusion.9 = bf16[1024,64]{1,0} fusion(%gemm_fusion_dot.7, %v.1), kind=kOutput, calls=%fused_computation.9
  %input_reduce_fusion = (f32[64]{0}, s32[64]{0}, /*index=2*/f32[]) fusion(%big.1), kind=kInput, calls=%r
  %fmha.1 = (bf16[8,2,16,4]{3,2,1,0}, u8[0]{0}) custom-call(%gemm_fusion_dot.7), custom_call_target="__cudnn$fmhaScaleBiasSoftmax"
  %while.4 = (s32[], f32[8]{0}) while(%tuple.0), condition=%cond, body=%body
  %gte = f32[] get-tuple-element(%input_reduce_fusion), index=2
  ROOT %tuple = (f32[], bf16[1024,512]{1,0}) tuple(%gte, %gemm_fusion_dot.7)
}
"""


def _module():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import aot_compile
    finally:
        sys.path.pop(0)
    return aot_compile


def test_kernel_bytes_and_kinds():
    aot = _module()
    ks = {k["name"]: k for k in aot.kernels(HLO)}
    # Parameters, bitcasts, get-tuple-element and tuple launch nothing.
    assert set(ks) == {
        "loop_convert_fusion.3", "gemm_fusion_dot.7", "fusion.9", "input_reduce_fusion",
        "fmha.1", "while.4",
    }  # fmt: skip
    convert = ks["loop_convert_fusion.3"]
    assert (convert["kind"], convert["read"], convert["written"]) == (
        "fusion:loop_convert_fusion",
        1024 * 256 * 4,
        1024 * 256 * 2,
    )
    gemm = ks["gemm_fusion_dot.7"]  # operands: the fusion's output and a parameter
    assert (gemm["read"], gemm["written"]) == (1024 * 256 * 2 + 256 * 512 * 2, 1024 * 512 * 2)
    # A tuple result counts every element, with the `/*index=2*/` comment in between.
    assert ks["input_reduce_fusion"]["written"] == 64 * 4 + 64 * 4 + 4
    assert ks["input_reduce_fusion"]["read"] == 64 * 1000 * 2
    assert ks["fmha.1"]["kind"] == "custom-call:__cudnn$fmhaScaleBiasSoftmax"
    assert (ks["while.4"]["kind"], ks["while.4"]["read"], ks["while.4"]["written"]) == (
        "while",
        0,
        0,
    )
    # Compute-bound: cuDNN, GEMM fusions by name, and a plain `fusion.N` (XLA:TPU's naming)
    # whose computation holds a dot; the convert and the reduce are memory-bound.
    bound = {name for name, k in ks.items() if aot.is_compute_bound(k)}
    assert bound == {"gemm_fusion_dot.7", "fusion.9", "fmha.1"}


def test_report_from_an_hlo_file(tmp_path):
    path = tmp_path / "p.hlo.txt"
    path.write_text(HLO)
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--hlo", str(path), "--bandwidth", "1e9", "--top", "1"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    # Memory-bound: the convert (1,048,576 + 524,288 B) and the reduce (128,000 + 516 B); the
    # while loop moves no bytes itself and its body is not counted.
    assert (
        "6 kernels; memory-bound kernels (all but matmuls and attention): 1.70 ms at 1 GB/s" in out
    )
    assert "1 while loop(s)" in out and "--scan_layers false" in out
    largest = out.split("largest memory-bound kernels")[1].splitlines()[1]
    assert "loop_convert_fusion.3" in largest and largest.split()[0] == "1.573"


GATHER_SCATTER = """HloModule jit_embed

%fused_gather (p0: f32[1000,64], p1: s32[8,1]) -> bf16[8,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[8,1]{1,0} parameter(1)
  %c = bf16[1000,64]{1,0} convert(%p0)
  %b = bf16[1000,64]{1,0} bitcast(%c)
  ROOT %g = bf16[8,64]{1,0} gather(%b, %p1), offset_dims={1}, slice_sizes={1,64}
}

%fused_gather_and_reduce (p0: f32[1000,64], p1: s32[8,1]) -> (bf16[8,64], f32[64]) {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[8,1]{1,0} parameter(1)
  %g = f32[8,64]{1,0} gather(%p0, %p1), offset_dims={1}, slice_sizes={1,64}
  %r = f32[64]{0} reduce(%p0, %z), dimensions={0}, to_apply=%add
  ROOT %t = (f32[8,64]{1,0}, f32[64]{0}) tuple(%g, %r)
}

%fused_scatter (p0: f32[1000,64], p1: s32[8,1], p2: bf16[8,64]) -> f32[1000,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[8,1]{1,0} parameter(1)
  %p2 = bf16[8,64]{1,0} parameter(2)
  %u = f32[8,64]{1,0} convert(%p2)
  ROOT %s = f32[1000,64]{1,0} scatter(%p0, %p1, %u), update_window_dims={1}, to_apply=%add
}

%fused_slices (p0: f32[1000,64]) -> (bf16[100,64], bf16[100,64]) {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %q = f32[100,64]{1,0} slice(%p0), slice={[0:100], [0:64]}
  %k = f32[100,64]{1,0} slice(%p0), slice={[100:200], [0:64]}
  %qc = bf16[100,64]{1,0} convert(%q)
  %kc = bf16[100,64]{1,0} convert(%k)
  ROOT %t = (bf16[100,64]{1,0}, bf16[100,64]{1,0}) tuple(%qc, %kc)
}

ENTRY %main (table: f32[1000,64], ids: s32[8,1], g: bf16[8,64]) -> f32[1000,64] {
  %table = f32[1000,64]{1,0} parameter(0)
  %ids = s32[8,1]{1,0} parameter(1)
  %g = bf16[8,64]{1,0} parameter(2)
  %input_gather_fusion = bf16[8,64]{1,0} fusion(%table, %ids), kind=kInput, calls=%fused_gather
  %input_reduce_fusion = (f32[8,64]{1,0}, f32[64]{0}) fusion(%table, %ids), kind=kInput, calls=%fused_gather_and_reduce
  %loop_slice_fusion = (bf16[100,64]{1,0}, bf16[100,64]{1,0}) fusion(%table), kind=kLoop, calls=%fused_slices
  ROOT %input_scatter_fusion = f32[1000,64]{1,0} fusion(%table, %ids, %g), kind=kInput, calls=%fused_scatter
}
"""


def test_gathers_slices_and_scatters_count_the_touched_rows():
    """An embedding lookup reads the 8 gathered rows of its table (in the table's dtype, through
    the convert), not the table; a table also reduced whole is read whole; two slices read their
    200 rows; the scatter of a gradient updates 8 rows in place (read and written back)."""
    ks = {k["name"]: k for k in _module().kernels(GATHER_SCATTER)}
    ids, rows_f32, rows_bf16 = 8 * 4, 8 * 64 * 4, 8 * 64 * 2
    assert ks["input_gather_fusion"]["read"] == rows_f32 + ids
    assert ks["input_gather_fusion"]["written"] == rows_bf16
    assert ks["input_reduce_fusion"]["read"] == 1000 * 64 * 4 + ids
    assert ks["loop_slice_fusion"]["read"] == 200 * 64 * 4
    scatter = ks["input_scatter_fusion"]
    assert (scatter["read"], scatter["written"]) == (rows_f32 + ids + rows_bf16, rows_f32)
