"""What `mirror-mlx tune` prints: predicted against measured, the calibration's acceptance, and how far
suffix ‖ rollout run together falls from Eq. 10's ideal."""

from .cost_model import describe, row_config
from .profile import Profile


def format_table(prof: Profile, top: int = 10) -> str:
    """Predicted vs measured tokens/s: the top predictions and every measured configuration."""
    rows = [r for i, r in enumerate(prof.table) if i < top or r.get("measured") is not None]
    lines = [f"{'configuration':<38} {'tok/step':>8} {'reuse':>6} {'step ms':>8} {'predicted':>10} {'measured':>9} "
             f"{'error':>7}"]
    for r in rows:
        m = r.get("measured")
        err = f"{100 * (r['predicted'] - m) / m:+.0f}%" if m else ""
        note = " (probe)" if r.get("confirmed", True) else " (probe, 1 prompt)"
        name = describe(row_config(r)) + (note if r.get("probe") else "")
        name += " split" if r.get("placement") == "split" else ""
        predicted = ("≤" if r.get("bound") else "") + f"{r['predicted']:.1f}"  # ≤: suffix ‖ rollout not measured
        lines.append(f"{name:<38} {r['tokens_per_step']:>8.2f} {100 * r['reuse']:>5.0f}% {r['step_ms']:>8.2f} "
                     f"{predicted:>10} {m if m is not None else float('nan'):>9.1f} {err:>7}")
    return "\n".join(lines)


def placement_line(prof: Profile) -> str:
    """Mirror's points measured in both core placements (tune/placement.py): tokens/s in each."""
    rows = [r for r in prof.table if r.get("placements")]
    if not rows:
        return ""
    return ("core placement, mirror (tok/s; the faster is the row's, auto and --mode mirror run it): " + "; ".join(
        describe(row_config(r)) + " "
        + ", ".join(f"{p} {v:.1f}" for p, v in r["placements"].items()) for r in rows))


def acceptance_line(prof: Profile) -> str:
    """The calibration's draft acceptance per γ, as `stats.acceptance_rate` reads it (what auto adapts from)."""
    acc = prof.calibration.get("acceptance") or {}
    return ("draft acceptance α per γ on the calibration text (auto compares stats.acceptance_rate with it): "
            + ", ".join(f"γ={g} {a / max(a + r, 1):.2f}" for g, (a, r) in acc.items())) if acc else ""


def contention(prof: Profile) -> str:
    """For the chosen mirror point: suffix ‖ rollout measured together against Eq. 10's ideal max()."""
    if prof.mode != "mirror":
        return ""
    t = prof.calibration["timings"]
    k, g, e = prof.kappa, prof.gamma, prof.exit_layer
    assert k is not None and g is not None and e is not None, "a mirror profile holds κ, γ and ℓ_e"
    suffix = t["suffix"][str((e, g + 1))]
    if t.get("comm"):  # across ranks: the suffix with its collectives, as suffix ‖ rollout was timed
        suffix += t["comm"][str(g + 1)] - t["comm_prefix"][str((e, g + 1))]
    rollout = t["rollout"][str((k * (g + 1), g))]
    together = t["parallel"].get(str((e, k, g)))
    point, apart = f"suffix ‖ rollout at κ={k} γ={g} ℓe={e}", f"max({1e3 * suffix:.2f}, {1e3 * rollout:.2f}) ms apart"
    if together is None:  # confirmed past the top (pick_confirm) by its real runs: its prediction used the floor
        return f"{point}: not timed together (confirmed by its real runs); {apart}"
    return f"{point}: {1e3 * together:.2f} ms together vs {apart} ({together / max(suffix, rollout):.2f}× the ideal)"


def comm_line(prof: Profile) -> str:
    """Across ranks: T_comm, the collectives of one target forward by row count, timed as a forward chains
    them (a term of the step model, cost_model.comm_time)."""
    comm = prof.calibration.get("timings", {}).get("comm") or {}
    if not comm:
        return ""
    return (f"T_comm across {prof.calibration.get('ranks', '?')} ranks, one target forward's collectives by rows "
            "(in each prediction's step): " + ", ".join(f"{n} {1e3 * v:.2f} ms" for n, v in comm.items()))
