"""Device presets: a CUDA device is found by its name (PCIe cards apart), one without a preset gets generic
figures and a warning saying how to give its own, and hardware refuses rates a plan would divide by."""

import math
import types

import pytest
import torch

from meshlight.parallel.presets import HARDWARE, detect_hardware, preset_named


def test_a_device_without_a_preset_gets_generic_figures_and_a_warning_that_says_how_to_give_its_own(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        name="NVIDIA L40S", total_memory=48 * 10**9))
    with pytest.warns(UserWarning) as caught:
        detected = detect_hardware(torch.device("cuda", 0), 4)
    assert detected.name == "NVIDIA L40S" and detected.memory == 48e9 and detected.devices_per_node == 4
    assert str(caught[0].message) == (
        "meshlight has no figures for the device 'NVIDIA L40S': the planner and TrainingMonitor's MFU assume 100"
        " TFLOP/s for its matmuls (16-bit and fp32 alike), 100 GB/s between the devices of a node and 25 GB/s"
        " between nodes. Give its own: Hybrid3DStrategy(hardware=meshlight.parallel.planner.Hardware(name,"
        " memory, peak_flops, intra_bandwidth, inter_bandwidth, fp32_flops=...)) and"
        " TrainingMonitor(peak_flops=...).")


@pytest.mark.parametrize(("name", "preset"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie"), ("NVIDIA A100 80GB PCIe", "a100-pcie"), ("NVIDIA B200", "b200"),
    ("AMD Instinct MI300X", "mi300x"), ("NVIDIA L40S", None)])
def test_a_device_is_found_by_its_cuda_name_pcie_cards_apart(name, preset):
    assert preset_named(name) is (HARDWARE[preset] if preset else None)


def test_hardware_refuses_rates_a_plan_would_divide_by():
    with pytest.raises(ValueError, match=r"host_bandwidth=0, host_step_rate=-1\.0: give values > 0"):
        HARDWARE["h100"].replace(host_bandwidth=0, host_step_rate=-1.0)
    with pytest.raises(ValueError, match=r"host_memory_bandwidth=0, host_threads=0: give values > 0"):
        HARDWARE["h100"].replace(host_memory_bandwidth=0, host_threads=0)
    with pytest.raises(ValueError, match=r"host_threads=nan: give values > 0"):
        HARDWARE["h100"].replace(host_threads=math.nan)


def test_cpu_hardware_shares_the_node_memory():
    assert detect_hardware(torch.device("cpu"), 4).memory < detect_hardware(torch.device("cpu"), 1).memory
