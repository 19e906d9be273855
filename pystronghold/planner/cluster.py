"""A cluster of unlike machines: nodes, their devices and links, read from a JSON or YAML file.

YAML needs PyYAML (``pip install 'pystronghold[yaml]'``)::

    {"inter_node_gbps": 12.5, "nodes": [{"name": "a", "host_memory_gib": 384,
      "devices": [{"type": "v100-32gb", "count": 8}]}]}

A device is a preset of ``planner.hardware.GPUS`` or ``memory_gib`` plus ``tflops``. Units: GiB
for memory, GB/s for links, TFLOP/s for compute. An unknown key is an error naming it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from pystronghold.planner.hardware import (DEFAULT_CPU_ADAM_RATE, GB, GPU, PCIE_GEN4, TFLOPS, GiB,
                                           Hardware, gpu_preset)

__all__ = ["Node", "Cluster", "load_cluster", "cluster_from_dict", "DEFAULT_INTER_NODE"]

DEFAULT_INTER_NODE = 12.5 * GB
"""Bytes/s per direction between nodes when the file gives none: 100 Gb/s Ethernet/InfiniBand EDR."""

_NODE_KEYS = {"name", "host_memory_gib", "cpu_adam_rate", "devices"}
_DEVICE_KEYS = {"type", "count", "memory_gib", "tflops", "link_gbps", "name"}


@dataclass(frozen=True, slots=True)
class Node:
    """One machine: its host (memory and CPU Adam shared by its devices) and its devices."""

    name: str
    """Name from the file (default ``node<i>``)."""
    host_memory_bytes: int
    """Host memory, bytes."""
    cpu_adam_params_per_s: float
    """Fused CPU AdamW rate of the whole host, parameters/s."""
    devices: tuple[GPU, ...]
    """Its accelerators, in file order."""


@dataclass(frozen=True, slots=True)
class Cluster:
    """Nodes and the link between them. Device i is the i-th device in node order (rank order)."""

    nodes: tuple[Node, ...]
    """The machines."""
    inter_node_bytes_per_s: float = DEFAULT_INTER_NODE
    """Per-direction bandwidth between two nodes, bytes/s."""

    @property
    def devices(self) -> list[GPU]:
        """Every device, node by node."""
        return [d for n in self.nodes for d in n.devices]

    def node_of(self, device: int) -> Node:
        """The node holding device ``device``; IndexError when out of range."""
        for node in self.nodes:
            if device < len(node.devices):
                return node
            device -= len(node.devices)
        raise IndexError("device index out of range")

    def hardware(self, device: int) -> Hardware:
        """The planner's ``Hardware`` of device ``device``: its GPU and its node's host."""
        node = self.node_of(device)
        return Hardware(gpu=self.devices[device], host_memory_bytes=node.host_memory_bytes,
                        cpu_adam_params_per_s=node.cpu_adam_params_per_s)

    def link_bytes_per_s(self, devices: list[int]) -> float:
        """Bandwidth of a collective over ``devices``: the inter-node link when they span nodes,
        else the slowest device interconnect among them."""
        nodes = {self.node_of(d).name for d in devices}
        if len(nodes) > 1:
            return self.inter_node_bytes_per_s
        return min(self.devices[d].interconnect_bytes_per_s for d in devices)


def _number(where: str, key: str, value, minimum_exclusive: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= minimum_exclusive:
        raise ValueError(f"cluster: {where}.{key} must be a positive number, got {value!r}")
    return float(value)


def _device(where: str, spec: dict, precision: str) -> tuple[GPU, int]:
    if not isinstance(spec, dict):
        raise ValueError(f"cluster: {where} must be a mapping, got {spec!r}")
    unknown = set(spec) - _DEVICE_KEYS
    if unknown:
        raise ValueError(f"cluster: {where} has unknown key {sorted(unknown)[0]!r}; known: {sorted(_DEVICE_KEYS)}")
    count = spec.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"cluster: {where}.count must be a positive int, got {count!r}")
    if "type" in spec:
        gpu = gpu_preset(str(spec["type"]))
    elif "memory_gib" in spec and "tflops" in spec:
        flops = _number(where, "tflops", spec["tflops"]) * TFLOPS
        gpu = GPU(name=str(spec.get("name", f"custom-{spec['memory_gib']:g}gb")), memory_bytes=GiB,
                  fp32_flops=flops, bf16_flops=flops, fp16_flops=flops,
                  h2d_bytes_per_s=PCIE_GEN4, d2h_bytes_per_s=PCIE_GEN4)
    else:
        raise ValueError(f"cluster: {where} needs a 'type' (a GPU preset) or 'memory_gib' and 'tflops'")
    if "memory_gib" in spec:
        gpu.memory_bytes = int(_number(where, "memory_gib", spec["memory_gib"]) * GiB)
    if "tflops" in spec:
        flops = _number(where, "tflops", spec["tflops"]) * TFLOPS
        gpu.fp32_flops = gpu.fp16_flops = flops
        gpu.bf16_flops = flops
    if "link_gbps" in spec:
        gpu.h2d_bytes_per_s = gpu.d2h_bytes_per_s = _number(where, "link_gbps", spec["link_gbps"]) * GB
    gpu.flops(precision)  # a device without the precision (bf16 on a V100) is refused here
    return gpu, count


def cluster_from_dict(spec: dict, precision: str = "fp32") -> Cluster:
    """The ``Cluster`` a parsed file describes (see the module docstring); ValueError naming the
    first bad entry. ``precision`` is the training precision every device must support."""
    if not isinstance(spec, dict) or not isinstance(spec.get("nodes"), list) or not spec["nodes"]:
        raise ValueError("cluster: the file needs a non-empty 'nodes' list")
    unknown = set(spec) - {"nodes", "inter_node_gbps"}
    if unknown:
        raise ValueError(f"cluster: unknown top-level key {sorted(unknown)[0]!r}; known: inter_node_gbps, nodes")
    nodes = []
    for i, node in enumerate(spec["nodes"]):
        where = f"nodes[{i}]"
        if not isinstance(node, dict):
            raise ValueError(f"cluster: {where} must be a mapping, got {node!r}")
        unknown = set(node) - _NODE_KEYS
        if unknown:
            raise ValueError(f"cluster: {where} has unknown key {sorted(unknown)[0]!r}; known: {sorted(_NODE_KEYS)}")
        if "host_memory_gib" not in node:
            raise ValueError(f"cluster: {where}.host_memory_gib is required")
        devices = node.get("devices")
        if not isinstance(devices, list) or not devices:
            raise ValueError(f"cluster: {where}.devices must be a non-empty list")
        gpus = []
        for j, dev in enumerate(devices):
            gpu, count = _device(f"{where}.devices[{j}]", dev, precision)
            gpus += [gpu] * count
        rate = _number(where, "cpu_adam_rate", node.get("cpu_adam_rate", DEFAULT_CPU_ADAM_RATE / 1e9)) * 1e9
        nodes.append(Node(name=str(node.get("name", f"node{i}")),
                          host_memory_bytes=int(_number(where, "host_memory_gib", node["host_memory_gib"]) * GiB),
                          cpu_adam_params_per_s=rate, devices=tuple(gpus)))
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"cluster: node names must be unique, got {names}")
    inter = _number("cluster", "inter_node_gbps", spec.get("inter_node_gbps", DEFAULT_INTER_NODE / GB)) * GB
    return Cluster(nodes=tuple(nodes), inter_node_bytes_per_s=inter)


def load_cluster(path: str | os.PathLike, precision: str = "fp32") -> Cluster:
    """Read a cluster file: ``.json``, or ``.yaml``/``.yml`` (needs PyYAML). ValueError on a bad
    file, with the path; FileNotFoundError when it is missing."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            from pystronghold.extras import missing

            if missing("yaml"):
                raise ValueError(f"cluster file {path}: YAML needs PyYAML (pip install 'pystronghold[yaml]'), "
                                 "or write the file as JSON")
            import yaml

            spec = yaml.safe_load(text)
        else:
            spec = json.loads(text)
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"cluster file {path}: {err}") from None
    except Exception as err:  # yaml.YAMLError; NOTE: yaml is optional, so its class is not importable here
        raise ValueError(f"cluster file {path}: {type(err).__name__}: {err}") from None
    try:
        return cluster_from_dict(spec, precision)
    except ValueError as err:
        raise ValueError(f"cluster file {path}: {err}") from None
