"""Plan quality: sacplan against the usual checkpointing alternatives, at equal memory.

    python benchmarks/plan_quality.py [--quick] [--no-compile] [--no-7b] [--timed R]

Real CPU section (per model: a 4-layer Llama at seq 256 with dropout 0, and cnn-tiny): every alternative
of :mod:`sacplan.alternatives` is applied and measured on a real training step (forward + backward), then
sacplan is solved at that alternative's *measured* peak and measured too. Stats are collected with exact
CPU sizes. sacplan's objective is recompute time on the tree's device; since this table compares FLOPs,
sacplan plans here on stats collected for a FLOP-objective spec (the CPU spec with infinite bandwidth, so
op time is proportional to FLOPs; sizes identical). "H100 ms" = FLOPs / (989.4 TFLOP/s bf16 x 0.75).

Fake section: Llama-7B shape (32 layers, seq 4096, bf16) collected for the H100: predicted peak and
predicted recompute time (sacplan's H100 roofline) of every alternative and of sacplan at the same peak,
no real allocation. Writes the Pareto picture to benchmarks/plan_quality.png.

At full AC's peak each section also prints :func:`sacplan.solver.certify`: the best plan over *every* plan
(every module as a unit, leaves and the root included, each with its whole Pareto front of save lists) and
the fractional lower bound — whether "a third of full AC" is reachable at all. The real steps are measured
by the profiler and cross-checked by sacplan's tracker on the real tensors (column "tracker"); "packed" is what
saved-tensor hooks saw packed outside checkpoint regions (all of it for no AC).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings

import torch

from sacplan import alternatives as alt
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import InfeasibleBudgetError
from sacplan.evaluate import predict
from sacplan.models import get_model
from sacplan.models.llama import Llama
from sacplan.solver import certify, min_feasible_budget, solve
from sacplan.tree import ModuleTree
from sacplan.validation import plan_choices

# Keeps the name "CPU": host-only size rules (oneDNN conv workspaces) are keyed on it.
FLOP_SPEC = dataclasses.replace(CPU, hbm_bandwidth=1e30)
MB = 1e6
POINTS: dict[str, list[tuple[str, float, float]]] = {}  # model -> [(label, peak MB, recompute GFLOP or ms)]
TIMED_ROUNDS = 0  # --timed R: also time each alternative and its sacplan plan (issue 26.4)


def _verdict(name: str, ours_peak: int, ours_rc: float, alt_peak: int, alt_rc: float, unit: str) -> str:
    ok_peak = ours_peak <= alt_peak * 1.01
    if ok_peak and ours_rc <= alt_rc * (1 + 1e-9):
        return f"  verdict {name}: sacplan ≤ alternative ({ours_rc:.4g} vs {alt_rc:.4g} {unit}, peak {ours_peak / MB:.3f} vs {alt_peak / MB:.3f} MB)"
    parts = []
    if not ok_peak:
        parts.append(f"peak +{(ours_peak / alt_peak - 1) * 100:.2f}%")
    if ours_rc > alt_rc:
        rel = f" (+{(ours_rc / alt_rc - 1) * 100:.1f}%)" if alt_rc > 0 else " (alternative recomputes nothing)"
        parts.append(f"recompute +{ours_rc - alt_rc:.4g} {unit}{rel}")
    return f"  verdict {name}: sacplan LOSES: " + ", ".join(parts)


def real_section(label: str, model_fn, inputs_fn, loss_fn, *, compile_budgets, ref_budgets: int = 2) -> None:
    t0 = time.time()
    torch.manual_seed(0)
    tree = ModuleTree(collect(model_fn, inputs_fn(), device=CPU, loss_fn=loss_fn, optimizer=False))
    torch.manual_seed(0)
    ftree = ModuleTree(collect(model_fn, inputs_fn(), device=FLOP_SPEC, loss_fn=loss_fn, optimizer=False))
    blocks = alt.find_blocks(tree)
    meas = lambda p, **kw: alt.measure(model_fn, inputs_fn, loss_fn, p, track=True, **kw)  # noqa: E731
    no_ac = meas(None)
    rows = []
    verdicts = []
    pairs: list[tuple[str, object, object]] = []  # (alternative, its plan or None, sacplan's plan at its measured peak)
    pts = POINTS.setdefault(label, [])

    def add(name, budget, m, ours=None, m_ours=None):
        rows.append((name, budget, m, ours, m_ours))
        pts.append((name, m["peak_bytes"] / MB, m["recompute_flops"] / 1e9))
        if m_ours is not None:
            verdicts.append(_verdict(name, m_ours["peak_bytes"], m_ours["recompute_flops"] / 1e9, m["peak_bytes"], m["recompute_flops"] / 1e9, "GFLOP"))

    def with_sacplan(name, plan_or_none, m):
        try:
            ours = solve(ftree, m["peak_bytes"])
        except InfeasibleBudgetError as e:
            rows.append((name, None, m, None, None))
            verdicts.append(f"  verdict {name}: sacplan infeasible at {m['peak_bytes']} B ({e})")
            return
        add(name, m["peak_bytes"], m, ours, meas(ours))
        if plan_or_none is not None:
            pairs.append((name, plan_or_none, ours))

    add("no AC", None, no_ac)
    for make in (alt.full_ac_plan, alt.every_other_block_plan, alt.torchtitan_op_sac_plan, alt.save_list_plan):
        p = make(tree, blocks)
        with_sacplan(p.status, p, meas(p))
    # PyTorch's reference sac_milp at budgets between full AC's peak and no AC's.
    lo = rows[1][2]["peak_bytes"]
    for b in alt.ladder(lo, no_ac["peak_bytes"], ref_budgets + 2)[1:-1]:
        plan, info = alt.reference_milp_plan(tree, b)
        if plan is None:
            verdicts.append(f"  verdict reference sac_milp @ {b / MB:.2f} MB: the reference found no plan")
            continue
        with_sacplan(f"reference sac_milp @{b / MB:.2f}MB", plan, meas(plan))
    for cb in compile_budgets:
        try:
            m = meas(None, compile_budget=cb)
        except Exception as e:  # noqa: BLE001 - report and go on
            verdicts.append(f"  torch.compile budget {cb}: failed ({type(e).__name__}: {str(e)[:120]})")
            continue
        with_sacplan(f"compile amb={cb}", None, m)
    # sacplan ladder.
    mf = min_feasible_budget(ftree)
    ladder_rows = []
    for b in alt.ladder(mf, no_ac["peak_bytes"], 5):
        ours = solve(ftree, b)
        m = meas(ours)
        ladder_rows.append((b, m))
        pts.append(("sacplan ladder", m["peak_bytes"] / MB, m["recompute_flops"] / 1e9))

    print(f"\n=== {label} (real CPU steps; blocks: {len(blocks)} x {tree.node(blocks[0]).stats.module_type}; "
          f"no-AC step {no_ac['flops'] / 1e9:.3f} GFLOP) ===")
    hdr = (f"{'alternative':<30} {'budget MB':>9} {'peak MB':>9} {'tracker':>9} {'saved MB':>9} {'packed':>8} {'rc GFLOP':>9} {'H100 ms':>8} | "
           f"{'sacplan peak MB':>15} {'rc GFLOP':>9} {'H100 ms':>8}")
    print(hdr)
    print("-" * len(hdr))
    for name, budget, m, ours, mo in rows:
        trk = "-" if m.get("tracker_peak_bytes") is None else f"{m['tracker_peak_bytes'] / MB:.3f}"
        left = (f"{name:<30} {('-' if budget is None else f'{budget / MB:.3f}'):>9} {m['peak_bytes'] / MB:9.3f} {trk:>9} "
                f"{m['saved_activation_bytes'] / MB:9.3f} {m['packed_bytes'] / MB:8.3f} {m['recompute_flops'] / 1e9:9.4f} "
                f"{alt.h100_ms(m['recompute_flops']):8.5f}")
        right = "" if mo is None else f"{mo['peak_bytes'] / MB:15.3f} {mo['recompute_flops'] / 1e9:9.4f} {alt.h100_ms(mo['recompute_flops']):8.5f}"
        print(left + " | " + right)
    print("sacplan ladder (min feasible .. no-AC peak):")
    for b, m in ladder_rows:
        print(f"  budget {b / MB:8.3f} MB -> peak {m['peak_bytes'] / MB:8.3f} MB, saved {m['saved_activation_bytes'] / MB:7.3f} MB, "
              f"rc {m['recompute_flops'] / 1e9:.4f} GFLOP ({alt.h100_ms(m['recompute_flops']):.5f} H100 ms)")
    for v in verdicts:
        print(v)
    runs = [m for _, _, m, _, _ in rows] + [mo for _, _, _, _, mo in rows if mo is not None] + [m for _, m in ladder_rows]
    diffs = [abs(m["tracker_peak_bytes"] / m["peak_bytes"] - 1) for m in runs if m.get("tracker_peak_bytes")]
    if diffs:
        print(f"  cross-check: sacplan's tracker on the real tensors vs the profiler's peak, {len(diffs)} eager steps: "
              f"max |difference| {max(diffs):.3%}; no AC: bytes kept for backward {no_ac['saved_activation_bytes'] / MB:.3f} MB, "
              f"packed by saved-tensor hooks {no_ac['packed_bytes'] / MB:.3f} MB")
    full_peak = rows[1][2]["peak_bytes"]
    if full_peak < no_ac["peak_bytes"] and rows[1][4] is not None:
        full_ms = predict(ftree, plan_choices(alt.full_ac_plan(ftree, blocks))).recompute_ms  # FLOP objective
        full_fl, ours_fl = rows[1][2]["recompute_flops"], rows[1][4]["recompute_flops"]
        print(f"  at full AC's peak: sacplan {ours_fl / 1e9:.4f} GFLOP = {ours_fl / full_fl:.2%} of full AC (measured); "
              f"over every plan: {certify(ftree, full_peak).summary(full_ms)}")
    if TIMED_ROUNDS:
        timed_table(model_fn, inputs_fn, loss_fn, pairs, {name: (m, mo) for name, _, m, _, mo in rows}, TIMED_ROUNDS)
    print(f"({label}: {time.time() - t0:.0f} s)")
    sys.stdout.flush()


def interleaved_ms(model_fn, inputs_fn, loss_fn, plans: dict[str, object], rounds: int) -> dict[str, list[float]]:
    """Wall ms of forward + backward of one model under each plan (None: no plan), in interleaved rounds (each
    round runs every plan once, so drift and load hit them alike), after one warm-up step each."""
    from sacplan.apply import apply_plan, remove_plan
    from sacplan.collector.calling import as_inputs, as_loss, call_model

    torch.manual_seed(0)
    model, args, loss = model_fn(), as_inputs(inputs_fn()), as_loss(loss_fn)
    model.train()

    def step() -> float:
        t = time.perf_counter()
        loss(call_model(model, args), args).backward()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t) * 1e3

    def use(plan) -> None:
        remove_plan(model)
        if plan is not None and getattr(plan, "decisions", ()):
            apply_plan(model, plan, check_fingerprint=False)

    out: dict[str, list[float]] = {k: [] for k in plans}
    for k, plan in plans.items():
        use(plan)
        step()
    for _ in range(rounds):
        for k, plan in plans.items():
            use(plan)
            out[k].append(step())
    remove_plan(model)
    return out


def timed_table(model_fn, inputs_fn, loss_fn, pairs, measured, rounds: int) -> None:
    """Issue 26.4: each alternative and sacplan at its measured peak, as measured CPU step time (median and
    spread of ``rounds`` interleaved steps) beside recomputed FLOPs."""
    plans: dict[str, object] = {"no AC": None}
    for name, plan, ours in pairs:
        plans[name], plans[name + " -> sacplan"] = plan, ours
    ms = interleaved_ms(model_fn, inputs_fn, loss_fn, plans, rounds)
    base = statistics.median(ms["no AC"])
    print(f"measured CPU step time (forward + backward, {rounds} interleaved rounds; no AC median {base:.1f} ms):")
    print(f"  {'alternative':<30} {'rc GFLOP':>9} {'extra ms':>9} {'spread':>17} | {'sacplan rc GFLOP':>16} {'extra ms':>9} {'spread':>17}")
    for name, _, _ in pairs:
        m, mo = measured[name]
        a, b = ms[name], ms[name + " -> sacplan"]
        spread = lambda t: f"{min(t) - base:+.1f}..{max(t) - base:+.1f}"  # noqa: E731
        print(f"  {name:<30} {m['recompute_flops'] / 1e9:9.4f} {statistics.median(a) - base:+9.1f} {spread(a):>17} | "
              f"{mo['recompute_flops'] / 1e9:16.4f} {statistics.median(b) - base:+9.1f} {spread(b):>17}")


def _ref_worker(tree_dict, budget, q):
    tree = ModuleTree.from_dict(tree_dict)
    try:
        plan, info = alt.reference_milp_plan(tree, budget)
        q.put((None if plan is None else plan.to_dict(), info))
    except Exception as e:  # noqa: BLE001
        q.put((None, {"error": f"{type(e).__name__}: {e}"}))


def fake_section() -> None:
    t0 = time.time()
    from sacplan.plan import Plan

    # Forward + backward only (no optimizer), like the CPU section: with AdamW the 7B step peaks in the
    # optimizer step (62.8 GiB) and no checkpointing choice changes the peak.
    stats = collect("llama-7b", device="h100", dtype=torch.bfloat16, batch=1, seq=4096, optimizer=False)
    tree = ModuleTree(stats)
    blocks = alt.find_blocks(tree)
    rows = []
    verdicts = []
    pts = POINTS.setdefault("llama-7b (fake, H100)", [])
    base = predict(tree, {})
    alts = [("no AC", {})]
    for make in (alt.full_ac_plan, alt.every_other_block_plan, alt.torchtitan_op_sac_plan, alt.save_list_plan):
        p = make(tree, blocks)
        alts.append((p.status, plan_choices(p)))
    # Reference sac_milp at the full-AC / no-AC midpoint, 60 s limit.
    full_peak = predict(tree, alts[1][1]).peak_bytes
    ref_budget = (full_peak + base.baseline_peak_bytes) // 2
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_ref_worker, args=(tree.to_dict(), ref_budget, q))
    tr = time.time()
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.terminate()
        proc.join()
        verdicts.append(f"  reference sac_milp @ {ref_budget / 2**30:.2f} GiB: did not finish in 60 s")
    else:
        pd, info = q.get()
        if pd is None:
            verdicts.append(f"  reference sac_milp @ {ref_budget / 2**30:.2f} GiB: no plan ({info})")
        else:
            alts.append((f"reference sac_milp @{ref_budget / 2**30:.1f}GiB ({time.time() - tr:.0f}s)", plan_choices(Plan.from_dict(pd))))
    for name, ch in alts:
        pr = predict(tree, ch)
        pts.append((name, pr.peak_bytes / 2**30, pr.recompute_ms))
        ours = None
        if ch:
            try:
                ours = solve(tree, pr.peak_bytes, time_limit_s=60)
            except InfeasibleBudgetError:
                ours = None
        rows.append((name, pr, ours))
        if ours is not None:
            pts.append(("sacplan at equal peak", ours.predicted_peak_bytes / 2**30, ours.recompute_ms))
            verdicts.append(_verdict(name, ours.predicted_peak_bytes, ours.recompute_ms, pr.peak_bytes, pr.recompute_ms, "ms"))
    print("\n=== llama-7b shape, 32 layers, seq 4096, bf16, H100 (fake mode, predicted; forward+backward, no optimizer) ===")
    hdr = f"{'alternative':<36} {'peak GiB':>9} {'rc ms':>9} {'rc TFLOP':>9} | {'sacplan peak GiB':>16} {'rc ms':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name, pr, ours in rows:
        right = "" if ours is None else f"{ours.predicted_peak_bytes / 2**30:16.3f} {ours.recompute_ms:9.2f}"
        print(f"{name:<36} {pr.peak_bytes / 2**30:9.3f} {pr.recompute_ms:9.2f} {pr.recompute_flops / 1e12:9.2f} | {right}")
    for v in verdicts:
        print(v)
    full_pr = predict(tree, alts[1][1])
    ours_full = rows[1][2]
    print(f"  at full AC's peak: sacplan {ours_full.recompute_ms:.2f} ms = {ours_full.recompute_ms / full_pr.recompute_ms:.2%} of full AC; "
          f"over every plan: {certify(tree, full_pr.peak_bytes, time_limit_s=120).summary(full_pr.recompute_ms)}")
    print(f"(llama-7b fake: {time.time() - t0:.0f} s)")


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(POINTS)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 5))
    axes = [axes] if n == 1 else list(axes)
    markers = "osD^v<>pPX*hH+x"
    for ax, (model, pts) in zip(axes, POINTS.items()):
        names = list(dict.fromkeys(p[0] for p in pts))
        others = [nm for nm in names if not nm.startswith("sacplan")]
        for nm in names:
            xs = [p[1] for p in pts if p[0] == nm]
            ys = [p[2] for p in pts if p[0] == nm]
            if nm.startswith("sacplan"):  # sacplan in black: a line for the ladder, stars at equal peaks
                ladder = nm == "sacplan ladder"
                ax.plot(xs, ys, "-o" if ladder else "*", color="black", label=nm, markersize=4 if ladder else 12, zorder=3)
            else:
                i = others.index(nm)
                ax.plot(xs, ys, markers[i % len(markers)], color=f"C{i % 10}", label=nm, markersize=8)
        fake = "fake" in model
        ax.set_xlabel("peak GiB (predicted)" if fake else "measured peak MB")
        ax.set_ylabel("recompute ms (predicted, H100)" if fake else "recompute GFLOP (measured)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="llama-tiny sizes, no compile, no 7B")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-7b", action="store_true")
    ap.add_argument("--only-7b", action="store_true", help="only the fake-mode Llama-7B section")
    ap.add_argument("--timed", type=int, default=0, metavar="R",
                    help="also measure CPU step time of each alternative and its sacplan plan in R interleaved rounds")
    a = ap.parse_args()
    global TIMED_ROUNDS
    TIMED_ROUNDS = a.timed
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t0 = time.time()
    cb = () if (a.quick or a.no_compile) else alt.COMPILE_BUDGETS
    if a.only_7b:
        fake_section()
        print(f"total {time.time() - t0:.0f} s")
        return
    if a.quick:
        P = get_model("llama-tiny")
        cfg = P.config.with_(n_layers=4, dropout=0.0)
        real_section("llama-tiny x4 (seq 128)", lambda: Llama(cfg), lambda: P.example_inputs(2, 128), P.loss_fn, compile_budgets=cb)
    else:
        P = get_model("llama-small")
        cfg = P.config.with_(n_layers=4, dropout=0.0)
        mfn = lambda: Llama(cfg)  # noqa: E731
        ifn = lambda: P.example_inputs(2, 256)  # noqa: E731
        real_section("llama-small x4 (batch 2, seq 256)", mfn, ifn, P.loss_fn, compile_budgets=cb)
    C = get_model("cnn-tiny")
    cnn_fn = lambda: C.build(dropout=0.0)  # noqa: E731
    cnn_in = lambda: C.example_inputs(8)  # noqa: E731
    real_section("cnn-tiny (batch 8)", cnn_fn, cnn_in, C.loss_fn, compile_budgets=cb)
    if not (a.quick or a.no_7b):
        fake_section()
    plot(os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_quality.png"))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
