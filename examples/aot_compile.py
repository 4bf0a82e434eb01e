"""Compile a training program for a GPU or TPU on a machine without one, and see where its
memory traffic goes.

    python examples/aot_compile.py [--target h100|tpu-v5e|tpu-v5p|tpu-v6e] [--algo forward|dpo]
        [--preset qwen2.5-0.5b] [--seq_len 1024] [--batch 8] [--scan_layers BOOL]
        [--remat_policy none|full|...] [--residual_dtype bfloat16] [--attention_impl IMPL]
        [--out program.hlo.txt]
    python examples/aot_compile.py --hlo program.hlo.txt [--bandwidth 3.0e12] [--top 25]

The first form builds the forward + backward of the SFT loss (what `python -m jaxrl.bench --algo
forward --bf16 true --gradient_checkpointing false` times) for a random model of the preset's
shape, bf16 compute over f32 params, and compiles it with XLA's compiler for one device of the
target (`jax.experimental.topologies`: no device, no autotuning): the H100 described below, or a
TPU chip. `--algo dpo` builds a DPO step's loss and gradients instead (`--batch` pairs in TRL's
layout, the policy and its frozen reference copy, the LM head on the completion span).
jaxrl's per-backend choices are made as on that device (GPU: cuDNN attention, one LM-head chunk,
bf16 head GEMM output, unrolled layers; TPU: splash attention, scanned layers).
So it also checks that the program compiles for hardware this machine does not have. It needs
JAX's CUDA plugin or libtpu, best in a separate environment so that the project's own stays
CPU-only:

    python -m venv --system-site-packages /tmp/aotvenv
    /tmp/aotvenv/bin/pip install "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"
    /tmp/aotvenv/bin/pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"
    JAX_PLATFORMS=cpu PYTHONPATH=. /tmp/aotvenv/bin/python examples/aot_compile.py --out /tmp/p.hlo

Both forms print, for the optimized program's top-level kernels, the bytes each reads and writes
(its operands and results) grouped by fusion kind, with the time they would take at
`--bandwidth` bytes/s, and the largest memory-bound kernels (all but matmuls and attention).
Without autotuning the GEMM fusions may differ from a real run's; the elementwise and reduction
kernels are what this is for. Operand bytes overcount kernels that read only part of an operand
(a gather, a slice): read the largest rows with that in mind. Kernels inside while loops (a
scanned layer stack) are not counted: compile with `--scan_layers false` to see them.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

# An H100 SXM (80 GB HBM3) as XLA's GPU compiler describes a device (`GpuTargetConfig`).
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 8 patch: 0 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*)")
# Not kernels: bookkeeping the runtime does without a launch.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start"}
_FREE |= {"copy-done", "after-all", "partition-id", "replica-id"}


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape string (a tuple counts all its elements)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def _computations(hlo: str) -> dict[str, str]:
    """Every computation's body by name."""
    return {
        m.group(1): m.group(2)
        for m in re.finditer(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.M | re.S)
    }


def _matmul_computations(hlo: str) -> set[str]:
    """Names of the computations that hold a dot or convolution (a fusion calling one is a
    matmul kernel, whatever its name: XLA:TPU names every fusion `fusion.N`)."""
    return {
        name
        for name, body in _computations(hlo).items()
        if re.search(r" (dot|convolution)\(", body)
    }


# Ops through which a fused parameter reaches a gather or slice without being read in full.
_PASS_THROUGH = {"bitcast", "convert", "reshape", "copy"}


def _instructions(body: str) -> dict[str, tuple[str, str, list[str], str]]:
    """A computation's instructions: name -> (shape, opcode, operand names, text after `op(`)."""
    out = {}
    for line in body.splitlines():
        m = _INSTR.match(re.sub(r"/\*.*?\*/", "", line).strip())
        if m:
            name, shape, op, rest = m.groups()
            out[name] = (
                shape,
                op,
                [a.strip().lstrip("%") for a in rest.split(")", 1)[0].split(",")],
                rest,
            )
    return out


def _param_index(instrs: dict, name: str) -> int | None:
    """The parameter number of `name` in a fused computation (None: not a parameter)."""
    shape, op, _, rest = instrs.get(name, ("", "", [], ""))
    return int(rest.split(")", 1)[0]) if op == "parameter" else None


# Ops that read only the elements they output from their first operand.
_PARTIAL_READS = {"gather", "slice", "dynamic-slice"}


def _partial_read_bytes(instrs: dict, index: int) -> int | None:
    """Bytes a fused computation reads of its parameter `index` when every use of it reaches the
    first operand of a gather or slice (through bitcasts, converts, reshapes): the elements those
    output, in the parameter's dtype, at most the whole array. None when it is read otherwise."""
    param = next(
        (
            n
            for n, (_, op, _, rest) in instrs.items()
            if op == "parameter" and rest.startswith(f"{index})")
        ),
        None,
    )
    if param is None:
        return None
    dtype = _ARRAY.search(instrs[param][0]).group(1)
    total, frontier = 0, [param]
    while frontier:
        value = frontier.pop()
        users = [(n, i) for n, i in instrs.items() if value in i[2] and n != value]
        if not users:
            return None  # the fusion's result itself: read in full
        for user, (shape, op, args, _) in users:
            if op in _PARTIAL_READS and args[0] == value and value not in args[1:]:
                elements = shape_bytes(shape) // _BYTES[_ARRAY.search(shape).group(1)]
                total += elements * _BYTES[dtype]
            elif op in _PASS_THROUGH:
                frontier.append(user)
            else:
                return None
    return min(total, shape_bytes(instrs[param][0]))


def kernels(hlo: str) -> list[dict]:
    """The entry computation's kernels: name, kind (`fusion:<name without digits>`,
    `custom-call:<target>` or the opcode), bytes read (operands) and written (results), and
    whether it is a matmul (a fusion whose computation holds a dot or convolution).

    A fused operand that only feeds gathers or slices counts the elements they take; a scatter
    fusion updates its first operand in place, so that operand counts as neither read nor
    written in full: the updates are read, and written back, instead."""
    bodies = _computations(hlo)
    matmuls = _matmul_computations(hlo)
    start = hlo.index("\nENTRY")
    entry = hlo[start : hlo.index("\n}", start)]
    header, body = entry.split("{\n", 1)
    sizes = {
        name: shape_bytes(shape)
        for name, shape in re.findall(r"([\w.\-]+): (\w+\[[0-9,]*\])", header)
    }
    out = []
    for line in body.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # `/*index=5*/` comments in long tuples
        m = _INSTR.match(line.strip())
        if not m:
            continue
        name, shape, op, rest = m.groups()
        sizes[name] = shape_bytes(shape)
        if op in _FREE:
            continue
        operands = [a.strip().lstrip("%") for a in rest.split(")", 1)[0].split(",")]
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        matmul = op in ("dot", "convolution") or (calls is not None and calls.group(1) in matmuls)
        if op == "fusion":
            kind = "fusion:" + re.sub(r"[.\d]+$", "", name)
        elif op == "custom-call":
            kind = "custom-call:" + re.search(r'custom_call_target="([^"]+)"', line).group(1)
        else:
            kind = op
        read_each = [sizes.get(a, 0) for a in operands]
        written = sizes[name]
        body = bodies.get(calls.group(1), "") if op == "fusion" and calls else ""
        fused = _instructions(body)
        root = re.search(r"ROOT %?[\w.\-]+ = \S+ ([\w\-]+)\(", body)
        if any(i[1] in _PARTIAL_READS for i in fused.values()):
            for i in range(len(operands)):
                partial = _partial_read_bytes(fused, i)
                read_each[i] = read_each[i] if partial is None else partial
        if op == "scatter" or (root and root.group(1) == "scatter"):
            # In place: only the updated elements are read, combined and written back.
            if op == "scatter":
                updates = sizes.get(operands[2], 0)
            else:
                scatter = next(i for i in fused.values() if i[1] == "scatter")
                updates = shape_bytes(fused[scatter[2][2]][0])
            operand = 0 if op == "scatter" else _param_index(fused, scatter[2][0])
            if operand is not None:
                read_each[operand] = updates
                written = updates
        read = sum(read_each)
        if op in ("while", "conditional", "call"):  # control flow: its bodies run the kernels
            read = written = sizes[name] = 0
        out.append(
            {
                "name": name,
                "kind": kind,
                "read": read,
                "written": written,
                "shape": shape,
                "matmul": matmul,
            }
        )
    return out


def is_compute_bound(kernel: dict) -> bool:
    """Matmuls and attention kernels (their time is arithmetic, not bytes): fusions holding a
    dot, cuBLAS/cuDNN/Triton calls and TPU custom calls (Pallas kernels: splash attention)."""
    kind = kernel["kind"]
    names = ("gemm", "cublas", "cudnn", "triton", "tpu_custom_call")
    return kernel["matmul"] or any(n in kind for n in names)


def report(hlo: str, bandwidth: float, top: int) -> str:
    ks = kernels(hlo)
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for k in ks:
        row = by_kind[k["kind"]]
        row[0] += 1
        row[1] += k["read"]
        row[2] += k["written"]
    lines = [f"{'kind':50s} {'kernels':>7s} {'GB read':>8s} {'GB written':>10s} {'ms':>8s}"]
    for kind, (n, read, written) in sorted(by_kind.items(), key=lambda kv: -sum(kv[1][1:])):
        ms = (read + written) / bandwidth * 1e3
        lines.append(f"{kind[:50]:50s} {n:7d} {read / 1e9:8.3f} {written / 1e9:10.3f} {ms:8.3f}")
    memory_bound = [k for k in ks if not is_compute_bound(k)]
    memory_ms = sum(k["read"] + k["written"] for k in memory_bound) / bandwidth * 1e3
    lines.append(
        f"{len(ks)} kernels; memory-bound kernels (all but matmuls and attention): "
        f"{memory_ms:.2f} ms at {bandwidth / 1e9:.0f} GB/s"
    )
    loops = sum(k["kind"] == "while" for k in ks)
    if loops:
        lines.append(
            f"{loops} while loop(s) (a scanned layer stack, chunked scans): the kernels inside"
            " their bodies are not counted above (compile with --scan_layers false)"
        )
    lines.append(f"largest memory-bound kernels (ms at {bandwidth / 1e9:.0f} GB/s):")
    for k in sorted(memory_bound, key=lambda k: -(k["read"] + k["written"]))[:top]:
        ms = (k["read"] + k["written"]) / bandwidth * 1e3
        lines.append(
            f"  {ms:7.3f}  read {k['read'] / 1e6:9.1f} MB  written {k['written'] / 1e6:9.1f} MB"
            f"  {k['name'][:44]:44s} {k['shape'][:60]}"
        )
    return "\n".join(lines)


def _topology(target: str):
    """A compile-only device for `target`, and the backend name jaxrl's choices follow."""
    from jax.experimental.topologies import get_topology_desc

    if target == "h100":
        return get_topology_desc("h100", "cuda", target_config=H100_TARGET, topology="1x1x1"), "gpu"
    chip = target.removeprefix("tpu-")  # e.g. v5e
    topology = get_topology_desc(
        topology_name=f"{chip}:1x1",
        platform="tpu",
        chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1),
        num_slices=1,
        wrap=(False, False, False),
    )
    return topology, "tpu"


def _model(opts: argparse.Namespace):
    """(compile device, graphdef, abstract params) of a random `opts.preset` model, bf16 compute
    over f32 params, with jaxrl's choices for the target's backend."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    try:
        topology, backend = _topology(opts.target)
    except Exception as e:  # no CUDA plugin / libtpu in this environment
        raise SystemExit(
            f"Could not make a {opts.target} compile target ({type(e).__name__}: {e}). Install "
            "JAX's CUDA plugin or libtpu in a separate environment (see this script's docstring)."
        ) from e
    jax.default_backend = lambda: backend  # jaxrl's per-backend choices, as on that device
    scan = opts.scan_layers if opts.scan_layers is not None else backend != "gpu"
    from jaxrl.models import presets
    from jaxrl.models.hf import _prepare_hf_config, build_model
    from jaxrl.models.hf_config import config_from_hf

    config = config_from_hf(
        _prepare_hf_config(presets.get_preset(opts.preset), "causal_lm", None),
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        residual_dtype=opts.residual_dtype,
        attention_impl=opts.attention_impl,
        scan_layers=scan,
        remat_policy=opts.remat_policy,
    )
    graphdef, params = nnx.split(
        nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0), "causal_lm", None, None))
    )
    device = jax.sharding.SingleDeviceSharding(topology.devices[0])
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params)
    return device, graphdef, params


def _lm_batch(shape: tuple[int, ...], device) -> dict:
    """Abstract collated rows of `shape` (`collate_sft` / pair rows: right-padded, not packed)."""
    import jax
    import jax.numpy as jnp

    keys = ("input_ids", "targets", "attention_mask", "positions")
    mb = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=device) for k in keys}
    mb["loss_mask"] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=device)
    return mb


def _compile(opts: argparse.Namespace, fn, *args) -> str:
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    print(
        f"compiled for {opts.target} in {time.perf_counter() - t0:.1f} s (no autotuning)",
        file=sys.stderr,
    )
    return compiled.as_text()


def compile_forward(opts: argparse.Namespace) -> str:
    """The optimized HLO of the SFT loss's forward + backward, compiled for `opts.target`."""
    import jax
    from flax import nnx

    from jaxrl.algos.sft import example_weighted_mask, lm_forward
    from jaxrl.losses.sft import entropy, mean_token_accuracy, sft_loss_sum

    device, graphdef, params = _model(opts)

    def loss(params, mb):  # as SFTTrainer's loss, with its statistics
        logps_BT, stats = lm_forward(nnx.merge(graphdef, params), mb, None, with_stats=True)
        mask_BT = example_weighted_mask(mb)
        loss_sum, n_tok = sft_loss_sum(logps_BT, mask_BT, loss_type="nll")
        correct, _ = mean_token_accuracy(stats["argmax_correct"], mask_BT)
        ent, _ = entropy(stats["entropy"], mask_BT)
        return loss_sum, (correct, ent, n_tok)

    mb = _lm_batch((opts.batch, opts.seq_len), device)
    return _compile(opts, jax.value_and_grad(loss, has_aux=True), params, mb)


def compile_dpo(opts: argparse.Namespace) -> str:
    """The optimized HLO of a DPO step's loss and gradients in TRL's layout (what `python -m
    jaxrl.bench --algo dpo` times, less the optimizer): `opts.batch` pairs of rows of
    `opts.seq_len` (prompt and completion half each, as the bench's synthetic pairs), the policy
    with statistics and the frozen reference copy (its matmul weights in bf16, as the trainers
    keep it), the LM head on the completion span only, TRL's sigmoid loss."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.algos.dpo import pair_logps
    from jaxrl.core import frozen
    from jaxrl.trainers.sft import choose_score_span

    device, graphdef, params = _model(opts)
    span = choose_score_span(opts.seq_len - opts.seq_len // 2, opts.seq_len)

    def loss(params, ref_params, mb):
        policy = pair_logps(nnx.merge(graphdef, params), mb, None, True, span)
        ref = pair_logps(nnx.merge(graphdef, ref_params), mb, None, False, span)
        ref = jax.lax.stop_gradient(ref)
        margin = (policy["chosen"] - ref["chosen"]) - (policy["rejected"] - ref["rejected"])
        stats = {k: jnp.sum(v) for k, v in policy.items() if "/" in k}
        return -jnp.sum(jax.nn.log_sigmoid(0.1 * margin)), stats

    mb = _lm_batch((opts.batch, 2, opts.seq_len), device)
    print(
        f"DPO: {opts.batch} pairs, LM head on {span} of {opts.seq_len} positions", file=sys.stderr
    )
    # The trainers' frozen copy: weights the forward only reads in bf16 stored in bf16.
    cast = frozen.cast_only_leaves(frozen.lm_probe(graphdef), params, jnp.bfloat16)
    ref_params = jax.tree.map(
        lambda x, c: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if c else x.dtype, sharding=device),
        params,
        cast,
    )
    return _compile(opts, jax.value_and_grad(loss, has_aux=True), params, ref_params, mb)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hlo", help="analyse this optimized HLO text instead of compiling")
    p.add_argument("--target", default="h100", choices=("h100", "tpu-v5e", "tpu-v5p", "tpu-v6e"))
    p.add_argument(
        "--scan_layers",
        type=lambda v: v.lower() in ("1", "true", "yes"),
        default=None,
        help="default: as the trainers choose (unrolled on GPU, scanned elsewhere)",
    )
    p.add_argument(
        "--algo",
        default="forward",
        choices=("forward", "dpo"),
        help="forward: the SFT loss's forward + backward; dpo: a DPO step's (--batch pairs)",
    )
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--residual_dtype", default=None)
    p.add_argument(
        "--remat_policy",
        default="none",
        help="none (the bench's --gradient_checkpointing false), full, dots_saveable, ...",
    )
    p.add_argument("--attention_impl", default=None)
    p.add_argument("--out", help="also write the compiled program's HLO text here")
    p.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s (H100 HBM3: ~3e12)")
    p.add_argument("--top", type=int, default=25)
    opts = p.parse_args(argv)
    compile_fn = compile_dpo if opts.algo == "dpo" else compile_forward
    hlo = Path(opts.hlo).read_text() if opts.hlo else compile_fn(opts)
    if opts.out:
        Path(opts.out).write_text(hlo)
    print(report(hlo, opts.bandwidth, opts.top))


if __name__ == "__main__":
    main()
