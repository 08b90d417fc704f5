"""`mirror-mlx doctor`: the macOS parts read recorded `sw_vers` / `sysctl` output and an MLComputePlan-shaped
record of the demo draft's Core ML package; here on Linux the command itself runs the CPU analog."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mirror_mlx import doctor
from mirror_mlx.tune import compute_plan

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_apple_silicon_mac_names_os_and_chip_without_problems():
    lines = doctor.mac_lines(fixture("sw_vers_macos14_5.txt"), fixture("sysctl_brand_m2pro.txt"),
                             fixture("sysctl_hw_model_m2pro.txt"), fixture("sysctl_proc_translated_native.txt"), "arm64")
    assert lines == ["OS: macOS 14.5 (23F79)", "chip: Apple M2 Pro (Mac14,9)"]


def test_intel_mac_is_told_it_lacks_the_gpu_and_neural_engine_path():
    lines = doctor.mac_lines(fixture("sw_vers_macos13_6_1.txt"), fixture("sysctl_brand_intel.txt"),
                             fixture("sysctl_hw_model_intel.txt"), None, "x86_64")  # Intel: no proc_translated key
    assert lines[:2] == ["OS: macOS 13.6.1 (22G313)", "chip: Intel(R) Core(TM) i7-9750H CPU @ 2.60GHz (MacBookPro16,1)"]
    assert lines[2].startswith("problem: not Apple silicon")
    assert len(lines) == 3


def test_python_under_rosetta_is_a_problem_with_the_fix():
    lines = doctor.mac_lines(fixture("sw_vers_macos15_1.txt"), fixture("sysctl_brand_rosetta.txt"),
                             fixture("sysctl_hw_model_m1air.txt"), fixture("sysctl_proc_translated_rosetta.txt"), "x86_64")
    assert lines[0] == "OS: macOS 15.1 (24B83)"
    assert lines[2].startswith("problem: this Python is x86_64 (under Rosetta)")
    assert "brew install python@3.12" in lines[2]


def test_apple_silicon_on_macos_13_is_told_mlx_needs_14():
    lines = doctor.mac_lines(fixture("sw_vers_macos13_6_1.txt"), fixture("sysctl_brand_m2pro.txt"),
                             fixture("sysctl_hw_model_m2pro.txt"), "0", "arm64")
    assert lines[2] == "problem: macOS 13.6.1: MLX needs macOS 14 or later"


def test_linux_cpu_name_from_cpuinfo():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n"
    assert doctor.linux_cpu(x86) == "AMD EPYC 7B13"
    assert doctor.linux_cpu("processor\t: 0\nBogoMIPS\t: 48.00\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n") == \
        "Raspberry Pi 4 Model B Rev 1.4"


def recorded_plan(record: dict):
    """An MLComputePlan over the record, built from coremltools' own classes: its methods answer from
    the record where on a Mac they would ask Core ML."""
    pytest.importorskip("coremltools")
    from coremltools.models import compute_device as cd
    from coremltools.models import compute_plan as cp

    devices = {"ANE": cd.MLNeuralEngineComputeDevice, "GPU": cd.MLGPUComputeDevice, "CPU": cd.MLCPUComputeDevice}
    device = lambda name: object.__new__(devices[name])  # noqa: E731  (Core ML's own objects need its runtime)
    usage, cost, functions = {}, {}, {}
    for fname, ops in record["functions"].items():
        operations = []
        for name, preferred, supported, weight in ops:
            op = cp.MLModelStructureProgramOperation(inputs={}, operator_name=name, outputs=[], blocks=[],
                                                     __proxy__=None)
            operations.append(op)
            if preferred is not None:
                usage[id(op)] = cp.MLComputePlanDeviceUsage(device(preferred), [device(d) for d in supported])
                cost[id(op)] = cp.MLComputePlanCost(weight)
        block = cp.MLModelStructureProgramBlock(inputs=[], operations=operations, output_names=[])
        functions[fname] = cp.MLModelStructureProgramFunction(inputs=[], block=block)
    structure = cp.MLModelStructure(neuralnetwork=None, program=cp.MLModelStructureProgram(functions), pipeline=None)

    class Proxy:
        model_structure = structure

        def get_compute_device_usage_for_mlprogram_operation(self, op):
            return usage.get(id(op))

        def get_estimated_cost_for_mlprogram_operation(self, op):
            return cost.get(id(op))

    plan = object.__new__(cp.MLComputePlan)
    plan.__proxy__ = Proxy()
    return plan


def test_compute_plan_report_counts_devices_and_names_ops_off_the_neural_engine():
    record = json.loads(fixture("compute_plan_llama2xs.json"))
    ops = compute_plan.op_devices(recorded_plan(record))
    assert list(ops) == ["extend", "rollout"]
    for fname, rows in record["functions"].items():  # consts run nowhere and are not counted
        assert [(o.name, o.device) for o in ops[fname]] == [(r[0], r[1]) for r in rows if r[1] is not None]

    rollout = [r for r in record["functions"]["rollout"] if r[1] is not None]
    n, dev = len(rollout), Counter(r[1] for r in rollout)
    ane_cost = sum(r[3] for r in rollout if r[1] == "ANE") / sum(r[3] for r in rollout)
    text = compute_plan.format_plan(ops).splitlines()
    assert len(text) == 3  # extend, rollout, and the rollout warning
    assert text[1] == (f"Core ML compute plan, rollout: ANE {dev['ANE']} ops ({100 * dev['ANE'] / n:.0f}%), "
                       f"CPU {dev['CPU']} ops ({100 * dev['CPU'] / n:.0f}%), GPU {dev['GPU']} ops ({100 * dev['GPU'] / n:.0f}%); "
                       f"ANE {100 * ane_cost:.0f}% of the estimated cost; off the Neural Engine: softmax x5, gather x3, cast x2")
    assert text[2].startswith(f"warning: {n - dev['ANE']} of {n} ops of the rollout function fell off the Neural Engine")
    assert "GPU" not in text[0] and "off the Neural Engine: cast x4, gather x3" in text[0]


def test_a_plan_all_on_the_neural_engine_has_no_warning():
    record = json.loads(fixture("compute_plan_llama2xs.json"))
    for rows in record["functions"].values():
        for r in rows:
            if r[1] is not None:
                r[1] = "ANE"
    text = compute_plan.format_plan(compute_plan.op_devices(recorded_plan(record)))
    assert "warning" not in text and "off the Neural Engine" not in text
    assert "ANE 100% of the estimated cost" in text


def doctor_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mirror_mlx", "doctor", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux analog")
def test_doctor_runs_here_and_says_what_only_a_mac_can_check():
    r = doctor_cli("--seconds", "1")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("mirror-mlx ") and out[0].endswith(" doctor")
    assert any(line.startswith("OS: Linux") for line in out)
    assert any(line.startswith("MLX: ") and "default device Device(cpu, 0)" in line for line in out)
    assert any(line.startswith("Core ML compute plan: skipped") for line in out)
    probe = next(i for i, line in enumerate(out) if line.startswith("overlap probe (the demo pair"))
    assert "CPU analog" in out[probe]
    assert out[probe + 1].startswith("  target forward alone ") and "draft rollout alone" in out[probe + 1]
    assert out[probe + 2].startswith("  both / longer alone = ")
    assert out[-1].startswith("not checked here (needs a Mac with Apple silicon)")
    assert not any(line.startswith("problem:") for line in out), r.stdout


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux analog")
def test_doctor_with_a_core_ml_draft_off_macos_says_why_each_part_is_skipped(tmp_path):
    package = tmp_path / "draft.mlpackage"
    package.mkdir()
    r = doctor_cli("--draft-model", str(package))
    assert r.returncode == 0, r.stderr
    assert "Core ML compute plan: skipped (MLComputePlan needs macOS 14.4+ (this is Linux))" in r.stdout
    assert f"overlap probe: skipped ({package} is a Core ML package: it runs only on macOS" in r.stdout
