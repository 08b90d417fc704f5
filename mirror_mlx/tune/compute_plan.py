"""Where a Core ML draft's ops run (MLComputePlan, macOS 14.4+), for `mirror-mlx tune` and `doctor`.

The draft hides behind the target only if its `rollout` function stays on the Neural Engine; Core
ML silently moves ops it cannot place there to the GPU (which the target is using) or the CPU.
Off macOS, or for an MLX draft, `report` says why there is nothing to report.
"""

import platform
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    from coremltools.models.compute_plan import MLComputePlan


DEVICE_NAMES = {"MLNeuralEngineComputeDevice": "ANE", "MLGPUComputeDevice": "GPU", "MLCPUComputeDevice": "CPU"}


def load_plan(package: Path) -> "MLComputePlan":
    """The package's MLComputePlan for CPU and Neural Engine (macOS 14.4+; compiles the package)."""
    import coremltools as ct  # (coremltools: an extra off macOS)
    from coremltools.models.compute_plan import MLComputePlan  # (coremltools: an extra off macOS)

    compiled = ct.models.utils.compile_model(str(package))
    return MLComputePlan.load_from_path(path=compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)


@dataclass(frozen=True)
class PlannedOp:
    name: str  # the operator, e.g. "conv"
    device: str  # ANE, GPU, CPU (or "other")
    cost: Optional[float]  # Core ML's estimated share of the function's work, if it gave one


def op_devices(plan: "MLComputePlan") -> dict[str, list[PlannedOp]]:
    """Per function of a loaded MLComputePlan, every op that runs somewhere (constants run nowhere and
    are left out) with its preferred device, named by its coremltools class."""
    out = {}
    for name, function in plan.model_structure.program.functions.items():
        ops = []
        for op in function.block.operations:
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            if usage is None:
                continue
            cost = plan.get_estimated_cost_for_mlprogram_operation(op)
            device = DEVICE_NAMES.get(type(usage.preferred_compute_device).__name__, "other")
            ops.append(PlannedOp(op.operator_name, device, None if cost is None else float(cost.weight)))
        out[name] = ops
    return out


def unavailable_reason(package: Union[str, Path, None]) -> Optional[str]:
    """Why no compute plan can be reported for the draft at `package` here, or None if one can."""
    if package is None or not str(package).endswith(".mlpackage"):
        return "the draft is not a Core ML package"
    if sys.platform != "darwin":
        return f"MLComputePlan needs macOS 14.4+ (this is {platform.system()})"
    mac = tuple(int(x) for x in (platform.mac_ver()[0] or "0").split(".")[:2])
    if mac < (14, 4):
        return f"MLComputePlan needs macOS 14.4+ (this is macOS {platform.mac_ver()[0]})"
    try:
        import coremltools.models.compute_plan  # noqa: F401  (coremltools: an extra off macOS)
    except ImportError as e:
        return f"coremltools has no MLComputePlan here ({e})"
    return None


def report(package: Union[str, Path, None]) -> str:
    """One line per function (op counts per device) and a warning if `rollout` left the Neural Engine."""
    reason = unavailable_reason(package)
    if reason is not None:
        return f"Core ML compute plan: skipped ({reason})"
    assert package is not None, "unavailable_reason names a missing package"
    return format_plan(op_devices(load_plan(Path(package))))


def format_plan(ops: dict[str, list[PlannedOp]]) -> str:
    """One line per function (op counts per device, the Neural Engine's share of the estimated cost,
    which kinds of op left it), and a warning if `rollout` left it: those ops compete with the target."""
    lines = []
    for name, planned in ops.items():
        counts = Counter(op.device for op in planned)
        total = sum(counts.values()) or 1
        off = Counter(op.name for op in planned if op.device != "ANE")
        line = f"Core ML compute plan, {name}: " + ", ".join(
            f"{dev} {n} ops ({100 * n / total:.0f}%)" for dev, n in counts.most_common())
        costs = [op.cost for op in planned if op.cost is not None]
        if costs and len(costs) == len(planned) and sum(costs) > 0:  # (every op's cost estimated)
            ane = sum(c for op, c in zip(planned, costs) if op.device == "ANE")
            line += f"; ANE {100 * ane / sum(costs):.0f}% of the estimated cost"
        if off:
            line += "; off the Neural Engine: " + ", ".join(f"{op} x{n}" for op, n in off.most_common())
        lines.append(line)
        if name == "rollout" and counts.get("ANE", 0) < total:
            lines.append(f"warning: {total - counts.get('ANE', 0)} of {total} ops of the rollout function fell off "
                         "the Neural Engine: the draft will compete with the target (convert with static shapes, "
                         "float16, or fewer rows)")
    return "\n".join(lines)
