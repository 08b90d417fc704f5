"""Where a Core ML draft's ops run (MLComputePlan, macOS 14.4+), for `mirror-mlx tune`.

The draft hides behind the target only if its `rollout` function stays on the Neural Engine; Core
ML silently moves ops it cannot place there to the GPU (which the target is using) or the CPU.
Off macOS, or for an MLX draft, `report` says why there is nothing to report.
"""

import platform
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional


def device_counts(package: Path) -> dict[str, Counter]:
    """Per function of the package: how many ops Core ML prefers on each device (ANE, GPU, CPU)."""
    import coremltools as ct
    from coremltools.models.compute_device import MLCPUComputeDevice, MLGPUComputeDevice, MLNeuralEngineComputeDevice
    from coremltools.models.compute_plan import MLComputePlan

    names = {MLNeuralEngineComputeDevice: "ANE", MLGPUComputeDevice: "GPU", MLCPUComputeDevice: "CPU"}
    compiled = ct.models.utils.compile_model(str(package))
    plan = MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    out = {}
    for name, function in plan.model_structure.program.functions.items():
        counts: Counter = Counter()
        for op in function.block.operations:
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            if usage is None:  # constants and other ops that run nowhere
                continue
            counts[next((v for k, v in names.items() if isinstance(usage.preferred_compute_device, k)), "other")] += 1
        out[name] = counts
    return out


def unavailable_reason(package: Any) -> Optional[str]:
    """Why no compute plan can be reported for the draft at `package` here, or None if one can."""
    if package is None or not str(package).endswith(".mlpackage"):
        return "the draft is not a Core ML package"
    if sys.platform != "darwin":
        return f"MLComputePlan needs macOS 14.4+ (this is {platform.system()})"
    mac = tuple(int(x) for x in (platform.mac_ver()[0] or "0").split(".")[:2])
    if mac < (14, 4):
        return f"MLComputePlan needs macOS 14.4+ (this is macOS {platform.mac_ver()[0]})"
    try:
        import coremltools.models.compute_plan  # noqa: F401
    except ImportError as e:
        return f"coremltools has no MLComputePlan here ({e})"
    return None


def report(package: Any) -> str:
    """One line per function (op counts per device) and a warning if `rollout` left the Neural Engine."""
    reason = unavailable_reason(package)
    if reason is not None:
        return f"Core ML compute plan: skipped ({reason})"
    lines = []
    for name, counts in device_counts(Path(package)).items():
        total = sum(counts.values()) or 1
        lines.append(f"Core ML compute plan, {name}: " +
                     ", ".join(f"{dev} {n} ops ({100 * n / total:.0f}%)" for dev, n in counts.most_common()))
        if name == "rollout" and counts.get("ANE", 0) < total:
            lines.append(f"warning: {total - counts.get('ANE', 0)} of {total} ops of the rollout function fell off "
                         "the Neural Engine: the draft will compete with the target (convert with static shapes, "
                         "float16, or fewer rows)")
    return "\n".join(lines)
