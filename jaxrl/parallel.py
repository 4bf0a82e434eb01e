"""Device mesh, logical-axis sharding rules and batch/param shardings.

Models name every parameter dimension with a logical axis (`embed`, `mlp`, `heads`, ...); the
rules below map those names onto the three mesh axes ("data", "fsdp", "tensor"). This file holds
no model code and does no computation beyond building shardings and placing host data.

Logical axis names used by `jaxrl.models`:
  batch (activations / batches), embed (model width D), mlp (MLP hidden F), heads (query heads),
  kv_heads (key/value heads), head_dim, vocab, layers (stacked scanned layers), norm (norm scales
  and biases), qkv (GPT-2's fused q/k/v), position (GPT-2 learned positions), labels (score and
  value head outputs).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger("jaxrl")

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated). Plain data so a
# YAML config can override any entry by name (see `merge_rules`).
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("experts", None),
    ("norm", None),
    ("qkv", None),
    ("position", None),
    ("labels", None),
)


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh; one size may be -1 meaning "all remaining devices"."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"make_mesh: at most one of data/fsdp/tensor may be -1, got {sizes}.")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"make_mesh: sizes must be positive (or -1), got {sizes}.")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if len(devices) % known:
            raise ValueError(
                f"make_mesh: {len(devices)} devices are not divisible by data*fsdp*tensor "
                f"(without the -1 axis) = {known}; pick sizes whose product divides the device count."
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"make_mesh: data*fsdp*tensor = {sizes[0]}*{sizes[1]}*{sizes[2]} = {math.prod(sizes)} "
            f"but there are {len(devices)} devices; make the product equal the device count or "
            "set one axis to -1."
        )
    return jax.make_mesh(tuple(sizes), MESH_AXES, (AxisType.Auto,) * 3, devices=devices)


def config_mesh(data: int, fsdp: int, tensor: int, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh a config's `mesh_data`/`mesh_fsdp`/`mesh_tensor` ask for. Like
    CUDA_VISIBLE_DEVICES, an explicit mesh (no -1) smaller than the device count uses the first
    devices (so `1, 1, 1` is one device); otherwise as `make_mesh`."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = (data, fsdp, tensor)
    if -1 not in sizes and math.prod(sizes) < len(devices):
        logger.warning("Mesh %s uses %d of %d devices.", sizes, math.prod(sizes), len(devices))
        devices = devices[: math.prod(sizes)]
    return make_mesh(*sizes, devices=devices)


def normalize_mesh(mesh: Mesh, rules: Rules | None = None) -> Mesh:
    """Accept any `jax.make_mesh` mesh whose axes the rules name ("data", "fsdp", "tensor" by
    default; any subset, a missing axis is size 1). Explicit or manual axes (JAX's default axis
    type) are re-declared Auto over the same devices: params and activations are sharded by
    name and the compiler propagates the rest, which explicit axes would forbid."""
    known = sorted({a for _, target in merge_rules(rules) for a in _as_axes(target)})
    unused = [name for name, size in mesh.shape.items() if size > 1 and name not in known]
    if unused:
        raise ValueError(
            f"Mesh axes {unused} (sizes {[mesh.shape[n] for n in unused]}) are not used by the "
            f"sharding rules, which shard over axes named {known}. Name the mesh axes from these, "
            "e.g. jax.make_mesh((2, 4), ('data', 'fsdp')) (a missing axis means size 1), or "
            "map logical axes onto your names with rules=[('embed', 'your_axis'), ...]."
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def _as_axes(target: MeshAxes) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def merge_rules(overrides: Iterable[Sequence[Any]] | None, base: Rules = DEFAULT_RULES) -> Rules:
    """`base` with entries of `overrides` (e.g. a YAML list of [name, mesh_axes] pairs) replaced by name."""
    merged = dict(base)
    for pair in overrides or ():
        if len(pair) != 2:
            raise ValueError(f"Sharding rule {pair!r} must be a [logical_axis, mesh_axes] pair.")
        name, target = pair
        merged[name] = tuple(target) if isinstance(target, list) else target
    return tuple(merged.items())


def _rule_table(rules: Rules | None) -> dict[str, MeshAxes]:
    # Given rules override the defaults by name, so a config may list only what it changes.
    return dict(merge_rules(rules))


def _mesh_axes_for(name: str | None, rules: Mapping[str, MeshAxes]) -> tuple[str, ...]:
    if name is None:
        return ()
    target = rules.get(name)
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(
    axes: Sequence[str | None],
    rules: Rules | None = None,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """PartitionSpec for logical `axes`; with `shape` and `mesh`, indivisible dims stay replicated.

    `rules` override `DEFAULT_RULES` by name (map a name to None to replicate it).

    A mesh axis is used at most once per spec (the first dim that claims it wins), since JAX
    forbids sharding two dims over the same mesh axis.
    """
    table = _rule_table(rules)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in enumerate(axes):
        mesh_axes = tuple(a for a in _mesh_axes_for(name, table) if a not in used)
        if mesh is not None:  # an axis the mesh lacks counts as size 1
            mesh_axes = tuple(a for a in mesh_axes if mesh.shape.get(a, 1) > 1)
        if shape is not None and mesh is not None and mesh_axes:
            if shape[dim] % math.prod(mesh.shape[a] for a in mesh_axes):
                mesh_axes = ()  # tiny or odd dims: replicate rather than fail
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names stored on an nnx Variable (replicated if it has none)."""
    axes = variable.get_metadata().get("out_sharding")
    return tuple(axes) if axes is not None else (None,) * len(variable.shape)


def param_shardings(state: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """NamedSharding for every Variable in `state` (abstract or real), same tree as `state`."""

    def one(v: nnx.Variable) -> NamedSharding:
        return NamedSharding(mesh, logical_to_spec(variable_axes(v), rules, v.shape, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
    """Sharding of a batch array: leading dim over the `batch` rule, other dims replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",), rules, mesh=mesh))


def data_parallel_size(mesh: Mesh, rules: Rules | None = None) -> int:
    """Number of ways the batch dim is split (product of the mesh axes `batch` maps to)."""
    table = _rule_table(rules)
    return math.prod(mesh.shape.get(a, 1) for a in _mesh_axes_for("batch", table))


def shard_batch(
    host_local_batch: Mapping[str, np.ndarray], mesh: Mesh, rules: Rules | None = None
) -> dict[str, jax.Array]:
    """Global arrays from this host's slice of the batch (batch dim split over data+fsdp)."""
    sharding = batch_sharding(mesh, rules)
    n_split = data_parallel_size(mesh, rules)
    out = {}
    for key, local in host_local_batch.items():
        local = np.asarray(local)
        global_rows = local.shape[0] * jax.process_count()
        if global_rows % n_split:
            raise ValueError(
                f"shard_batch: global batch size {global_rows} of '{key}' is not divisible by the "
                f"data-parallel size {n_split}; use a batch size that is a multiple of it."
            )
        global_shape = (global_rows, *local.shape[1:])
        out[key] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out


def to_host(x: Any) -> Any:
    """A pytree of (possibly multi-host) jax Arrays as numpy, each the whole global array on
    every process: `device_get` where the array is local, an all-gather where it spans hosts."""

    def one(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            return np.asarray(jax.device_get(a))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(one, x)


def initialize_distributed() -> None:
    """Call `jax.distributed.initialize()` on multi-host setups; no-op on a single host.

    Multi-host is detected from the usual launcher variables (JAX coordinator, SLURM, Open MPI)
    or a TPU pod slice (more than one TPU worker host listed). Without a cluster manager, set
    JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on
    every process (e.g. several processes on one machine over loopback, as the tests do).
    """
    env = os.environ
    tpu_hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    multi_host = (
        "JAX_COORDINATOR_ADDRESS" in env
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or len(tpu_hosts) > 1
    )
    if multi_host and not jax.distributed.is_initialized():
        explicit = {}
        if "JAX_NUM_PROCESSES" in env and "JAX_PROCESS_ID" in env:
            explicit = dict(
                coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                num_processes=int(env["JAX_NUM_PROCESSES"]),
                process_id=int(env["JAX_PROCESS_ID"]),
            )
        jax.distributed.initialize(**explicit)
