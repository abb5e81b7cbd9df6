"""Independent oracles the solver tests share: events re-derived from the stats, antichains of the module tree,
brute force over op-level options, and random trees with op lists (no sacplan solver code inside)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np

from sacplan.testing.synthetic import MiB, Spec, ops_from_rows


def oracle(tree, world_size, with_root=False):
    """Candidates as ``solve`` picks them (every module with discardable activations, leaves included, the
    root only with ``with_root``), base event bytes, discard coefficients C and recompute extras X."""
    s = tree.stats
    keep = s.world_size / (world_size or s.world_size)
    cands = [
        n
        for n in tree.nodes
        if (with_root or n.parent is not None)
        and n.stats.tradeoff is not None
        and n.stats.tradeoff.max_discard_bytes > 0
        and n.fqn in s.fw_post_order
    ]
    E, S = len(s.events), len(cands)
    base = np.zeros(E)
    C = np.zeros((E, S))
    X = np.zeros((E, S))
    occ_fw, occ_bw = [], []
    seen: dict[str, int] = {}
    for f in s.fw_post_order:
        occ_fw.append(seen.get(f, 0))
        seen[f] = seen.get(f, 0) + 1
    seen = {}
    for f in s.bw_pre_order:
        occ_bw.append(seen.get(f, 0))
        seen[f] = seen.get(f, 0) + 1
    for e, ev in enumerate(s.events):
        base[e] = ev.peak_bytes - ev.state_bytes * (1 - keep)
        for j, n in enumerate(cands):
            act = n.stats.act_bytes
            if ev.phase == "fw":
                C[e, j] = sum(act[occ_fw[p]] for p in range(ev.fw_done) if s.fw_post_order[p] == n.fqn)
            elif ev.phase in ("bw", "rc"):
                C[e, j] = sum(
                    act[occ_bw[p]] for p in range(ev.bw_started, len(s.bw_pre_order)) if s.bw_pre_order[p] == n.fqn
                )
                if ev.phase == "rc" and ev.module == n.fqn:
                    X[e, j] = ev.extra_bytes
    return cands, base, C, X


def antichains(tree, cands):
    for k in range(0, len(cands) + 1):
        for combo in itertools.combinations(range(len(cands)), k):
            nodes = [cands[j] for j in combo]
            if any(a.is_ancestor_of(b) or b.is_ancestor_of(a) for a, b in itertools.combinations(nodes, 2)):
                continue
            yield combo


def subsets(ops, A, R, dispatch_ms=0.0):
    """(r, q) of every subset of non-view ops saved within A bytes, plus the full checkpoint (1, 1).

    ``dispatch_ms``: what a selective region costs per call beyond a plain one; every subset is priced with it, the
    full checkpoint (plain) without (modules without buffers or forced saves)."""
    free = [o for o in ops if not o.is_view]
    total_ms = sum(o.runtime_ms for o in ops)
    out = [(1.0, 1.0)]
    for k in range(len(free) + 1):
        for S in itertools.combinations(free, k):
            saved = sum(o.save_cost_bytes for o in S)
            if saved > A:
                continue
            out.append(((A - saved) / A, (total_ms - sum(o.runtime_ms for o in S) + dispatch_ms) / R))
    return out


def pareto_points(points):
    front = []
    for r, q in sorted(points, key=lambda p: (-p[0], p[1])):
        if not front or q < front[-1][1] - 1e-12:
            if front and abs(r - front[-1][0]) <= 1e-15:
                continue
            front.append((r, q))
    return front[::-1]


def random_option_spec(rng: random.Random) -> Spec:
    """Root with 1-3 checkpointable modules (each with an op list and a leaf child), maybe nested."""
    root = Spec("m", params=rng.randint(0, 2) * 32 * MiB, fw_ms=0.1)
    mods = []
    for k in range(rng.randint(1, 3)):
        rows = []
        for j in range(rng.randint(2, 4)):
            rows.append((rng.choice(["aten.mm.default", "aten.mul.Tensor", "aten.silu.default"]),
                         rng.randint(1, 8) * 16 * MiB, round(rng.uniform(0.05, 3.0), 3), 0))
        if rng.random() < 0.5:
            rows.insert(1, ("aten.view.default", 0, 0.0, 0, "view"))
        ops = ops_from_rows(rows)
        act = sum(o.save_cost_bytes for o in ops)
        sp = Spec(f"c{k}", act=act, fw_ms=sum(o.runtime_ms for o in ops), ops=ops,
                  tmp=rng.randint(0, 4) * 16 * MiB, params=rng.randint(0, 2) * 32 * MiB,
                  repeat=rng.choice((1, 1, 2)))
        sp.children.append(Spec(f"leaf{k}", act=rng.randint(0, 2) * 16 * MiB, fw_ms=0.0, no_tradeoff=True))
        parent = mods[rng.randrange(len(mods))] if mods and rng.random() < 0.3 else root
        parent.children.append(sp)
        mods.append(sp)
    return root


def brute_over_options(tree, cands, base, C, X, budget, options):
    """Cheapest (cost, min peak) over antichains × per-candidate options [(r, q)] (q in units of calls·R)."""
    best, min_peak = math.inf, math.inf
    for combo in antichains(tree, cands):
        extra = X[:, list(combo)].sum(axis=1) if combo else 0.0
        for choice in itertools.product(*[options[j] for j in combo]):
            r = np.zeros(len(cands))
            cost = 0.0
            for j, (rj, qj) in zip(combo, choice):
                r[j] = rj
                t = cands[j].stats.tradeoff
                cost += len(cands[j].stats.act_bytes) * t.full_recompute_ms * qj
            peak = float(np.max(base - C @ r + extra))
            min_peak = min(min_peak, peak)
            if peak <= budget and cost < best:
                best = cost
    return best, min_peak


def option_sets(cands):
    """Per candidate, its exact options ``[(ratio, recompute fraction)]`` (module_options on its own op list)."""
    from sacplan.solver.ops import module_options

    out = []
    for n in cands:
        t = n.stats.tradeoff
        o = module_options(n.stats.ops, t.max_discard_bytes, t.full_recompute_ms,
                           recompute_stop=n.stats.recompute_stop or None)
        out.append(list(zip(o.ratio, o.frac)))
    return out


def random_budget_case(seed: int, u: float):
    """A random option tree (:func:`random_option_spec`) and a budget at ``u`` of the way from a byte under its
    minimum peak (infeasible) to its no-checkpointing peak, with the brute-force optimum over every option:
    ``(tree, budget, brute cost, option sets)``, or None when the tree has no candidate or nothing to save."""
    from sacplan.testing.synthetic import build_tree

    tree = build_tree(random_option_spec(random.Random(seed)))
    cands, base, C, X = oracle(tree, None)
    if not cands:
        return None
    baseline = float(np.max(base))
    _, min_peak = brute_over_options(tree, cands, base, C, X, math.inf, [[(1.0, 1.0)] for _ in cands])
    if not min_peak < baseline - 1:
        return None
    budget = int(min_peak - 1 + u * (baseline - min_peak))  # a few budgets below the minimum: infeasible
    opts = option_sets(cands)
    brute, _ = brute_over_options(tree, cands, base, C, X, budget, opts)
    return tree, budget, brute, opts
