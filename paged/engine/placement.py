"""Where a replica's arrays live: its devices, its mesh, and how params and KV are sharded.

An engine replica runs on ``T`` devices (``tensor_parallel_size``) as a one-axis mesh named
``"model"``. Tensor parallel shards, over that axis:

* the KV pages on the KV-head axis (``[L, K, P, page, H]``: axis 1), so each device holds
  ``K / T`` heads of every page and one block manager serves all shards;
* the attention projections by head (``q_proj``/``k_proj``/``v_proj`` ``[D, heads, H]`` on axis
  1, their biases on axis 0, ``o_proj`` ``[heads, H, D]`` on axis 0) and the MLP by its hidden
  dimension (``gate``/``up`` ``[D, F]`` on axis 1, ``down`` ``[F, D]`` on axis 0): the Megatron
  split, where XLA inserts one all-reduce after ``o_proj`` and one after ``down`` per layer;
* nothing else: embeddings, norms and ``lm_head`` are replicated.

Query heads are split in contiguous groups, as are KV heads, so grouped-query attention keeps
each query head on the device of its KV head. With ``T = 1`` the mesh has one device and every
array is simply committed to it, which is how data-parallel replicas keep to their own devices.

``split_devices`` divides a device list among ``D`` replicas of ``T`` devices each and raises
``ValueError`` naming the numbers for combinations that do not fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "model"

# Param leaf name -> the axis sharded over the model axis (others are replicated).
_SHARDED_AXIS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 0, "q_bias": 0, "k_bias": 0,
                 "v_bias": 0, "gate": 1, "up": 1, "down": 0}


def split_devices(devices: Sequence, data_parallel_size: int, tensor_parallel_size: int,
                  num_kv_heads: int) -> list[list]:
    """``data_parallel_size`` lists of ``tensor_parallel_size`` devices each, in order.

    Raises:
      ValueError: D x T exceeds the devices, or ``num_kv_heads`` is not divisible by T.
    """
    devices = list(devices)
    need = data_parallel_size * tensor_parallel_size
    if need > len(devices):
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
                         f"{tensor_parallel_size} = {need} devices, but only {len(devices)} are "
                         f"available ({devices[0].platform if devices else 'none'})")
    if num_kv_heads % tensor_parallel_size:
        raise ValueError(f"num_kv_heads={num_kv_heads} is not divisible by "
                         f"tensor_parallel_size={tensor_parallel_size}")
    t = tensor_parallel_size
    return [devices[i * t:(i + 1) * t] for i in range(data_parallel_size)]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A replica's mesh (one axis, ``"model"``) and the shardings of its arrays."""

    mesh: Mesh

    @classmethod
    def on(cls, devices: Sequence) -> Placement:
        return cls(Mesh(np.array(list(devices), dtype=object), (AXIS,)))

    @classmethod
    def for_replica(cls, num_kv_heads: int, tensor_parallel_size: int, *, mesh: Mesh | None = None,
                    devices: Sequence | None = None) -> Placement:
        """One replica's placement: ``mesh`` as given (it must have a ``"model"`` axis), else the
        first ``tensor_parallel_size`` of ``devices`` (default ``jax.devices()``).

        Raises:
          ValueError: too few devices, a mesh without a model axis, or KV heads that its size
            does not divide.
        """
        if mesh is None:
            return cls.on(split_devices(jax.devices() if devices is None else devices, 1,
                                        tensor_parallel_size, num_kv_heads)[0])
        if devices is not None:
            raise ValueError("pass devices or mesh, not both")
        if AXIS not in mesh.axis_names:
            raise ValueError(f"mesh axes {mesh.axis_names} must include 'model' (KV heads)")
        if num_kv_heads % mesh.shape[AXIS]:
            raise ValueError(f"num_kv_heads={num_kv_heads} is not divisible by the mesh's model "
                             f"axis ({mesh.shape[AXIS]})")
        return cls(mesh)

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def kv(self) -> NamedSharding:
        """KV pages ``[L, K, P, page, H]``: KV heads over the model axis."""
        return NamedSharding(self.mesh, PartitionSpec(None, AXIS))

    def param_sharding(self, path, leaf) -> NamedSharding:
        """The sharding of one param leaf (by its name; replicated when the axis does not
        divide by the mesh size)."""
        name = getattr(path[-1], "key", None) if path else None
        axis = _SHARDED_AXIS.get(name)
        if axis is not None and any(getattr(p, "key", None) == "layers" for p in path):
            axis += 1  # stacked layers (paged.models.scan_layers): the layer axis comes first
        shape = np.shape(leaf)
        if axis is None or self.size == 1 or len(shape) <= axis or shape[axis] % self.size:
            return self.replicated
        spec = [None] * len(shape)
        spec[axis] = AXIS
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def put_params(self, params):
        """``params`` on this replica's devices, sharded for tensor parallel."""
        shardings = jax.tree_util.tree_map_with_path(self.param_sharding, params)
        return jax.device_put(params, shardings)

    def put(self, x):
        """A host array replicated on this replica's devices."""
        return jax.device_put(x, self.replicated)


__all__ = ["AXIS", "Placement", "split_devices"]
