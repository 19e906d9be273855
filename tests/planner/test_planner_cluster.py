"""Cluster files: presets and custom devices, JSON and YAML, links, bad entries named."""

from __future__ import annotations

import json

import pytest

from pystronghold.planner.cluster import cluster_from_dict, load_cluster
from pystronghold.planner.hardware import GB, TFLOPS, GiB

SPEC = {"inter_node_gbps": 25,
        "nodes": [{"name": "v", "host_memory_gib": 384, "devices": [{"type": "v100-32gb", "count": 2}]},
                  {"name": "p", "host_memory_gib": 256, "cpu_adam_rate": 1.5,
                   "devices": [{"memory_gib": 16, "tflops": 9.3, "count": 2, "name": "p100"}]}]}


def test_presets_and_custom_devices_resolve_to_datasheet_figures(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(SPEC))
    cluster = load_cluster(path)
    devices = cluster.devices
    assert [d.name for d in devices] == ["v100-32gb", "v100-32gb", "p100", "p100"]
    assert devices[0].fp32_flops == 15.7 * TFLOPS and devices[0].memory_bytes == 32 * GiB
    assert devices[3].fp32_flops == 9.3 * TFLOPS and devices[3].memory_bytes == 16 * GiB
    hw = cluster.hardware(2)
    assert hw.host_memory_bytes == 256 * GiB and hw.cpu_adam_params_per_s == 1.5e9
    assert cluster.link_bytes_per_s([0, 1]) == 150 * GB  # NVLink inside the V100 node
    assert cluster.link_bytes_per_s([1, 2]) == 25 * GB  # across nodes


def test_yaml_cluster_file_loads_like_json(tmp_path):
    import yaml  # the [yaml] extra, in the dev venv (Makefile)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    assert len(load_cluster(path).devices) == 4


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s["nodes"][0]["devices"][0].update(type="v200"), "unknown GPU 'v200'"),
    (lambda s: s["nodes"][0].update(host_memory=3), "nodes\\[0\\] has unknown key 'host_memory'"),
    (lambda s: s["nodes"][1]["devices"][0].pop("tflops"), "needs a 'type' .* or 'memory_gib' and 'tflops'"),
    (lambda s: s["nodes"][1]["devices"][0].update(count=0), "devices\\[0\\].count must be a positive int"),
    (lambda s: s["nodes"][1].update(name="v"), "node names must be unique"),
    (lambda s: s.update(nodes=[]), "non-empty 'nodes' list"),
    (lambda s: s["nodes"][0].pop("host_memory_gib"), "nodes\\[0\\].host_memory_gib is required"),
], ids=["unknown-preset", "unknown-key", "no-tflops", "count-0", "duplicate-name", "no-nodes", "no-host"])
def test_bad_entries_are_named(mutate, message):
    spec = json.loads(json.dumps(SPEC))
    mutate(spec)
    with pytest.raises(ValueError, match=message):
        cluster_from_dict(spec)


def test_bf16_on_a_v100_is_refused_and_bad_files_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="v100-32gb has no bf16 support"):
        cluster_from_dict(SPEC, precision="bf16")
    bad = tmp_path / "bad.json"
    bad.write_text("{nodes: ")
    with pytest.raises(ValueError, match="cluster file .*bad.json"):
        load_cluster(bad)


def test_yaml_without_pyyaml_says_how_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "yaml", None)  # find_spec now answers "not installed"
    path = tmp_path / "c.yaml"
    path.write_text("nodes: []")
    with pytest.raises(ValueError, match=r"YAML needs PyYAML \(pip install 'pystronghold\[yaml\]'\)"):
        load_cluster(path)
