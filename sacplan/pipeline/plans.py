"""One plan for a whole pipeline: every rank's :class:`~sacplan.plan.Plan`, and each stage's part of it.

:func:`solve_pipeline` plans every rank of :func:`~sacplan.pipeline.collect_pipeline`'s stats; the
:class:`PipelinePlan` it returns prints one plan per stage, saves as one versioned JSON file (its own schema,
``sacplan.pipeline-plan-file``, next to the single-model ``sacplan.plan-file``, which is unchanged) and hands each
stage its part: :meth:`PipelinePlan.for_stage` (``apply_plan(stage_module, plan, stage=i)`` calls it) picks the
decisions of stage ``i`` — under an interleaved schedule the rank's plan names modules ``stage<i>.<name>``, the
stage's part drops that prefix — and checks the module against the fingerprint recorded for stage ``i`` when the
stats were collected.

File layout (version 1)::

    {"schema": "sacplan.pipeline-plan-file", "version": 1, "sacplan_version", "torch_version", "created",
     "pipeline": {"schedule", "microbatches", "num_ranks", "num_stages", "stage_fingerprints": [...]},
     "ranks": [{"rank": r, "stages": [...], "plan": Plan.to_dict()}, ...]}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from sacplan.errors import ConfigError, PlanError, PlanMismatchError
from sacplan.plan import Plan
from sacplan.stats import ModelStats

__all__ = ["PIPELINE_PLAN_FILE_VERSION", "PipelinePlan", "load_pipeline_plan", "solve_pipeline"]

PIPELINE_PLAN_FILE_VERSION = 1
SCHEMA = "sacplan.pipeline-plan-file"


@dataclass(frozen=True)
class PipelinePlan:
    """Every pipeline rank's plan.

    Attributes:
        schedule: the torch schedule class name (``"Schedule1F1B"``...).
        microbatches, num_ranks, num_stages: the pipeline planned for.
        rank_stages: per rank, the stage indices it holds.
        plans: per rank, its :class:`~sacplan.plan.Plan` (module names as in the rank's stats).
        stage_fingerprints: per stage, its module's fingerprint (:func:`sacplan.fingerprint.model_fingerprint`).
    """

    schedule: str
    microbatches: int
    num_ranks: int
    num_stages: int
    rank_stages: tuple[tuple[int, ...], ...]
    plans: tuple[Plan, ...]
    stage_fingerprints: tuple[str, ...]

    def for_rank(self, rank: int) -> Plan:
        """Rank ``rank``'s plan, for the module :func:`~sacplan.pipeline.rank_module` builds (its stage, or the
        :class:`~sacplan.pipeline.PipelineRank` of its stages)."""
        if not 0 <= rank < self.num_ranks:
            raise ConfigError(f"rank {rank} is outside this pipeline plan's {self.num_ranks} ranks")
        return self.plans[rank]

    def rank_of(self, stage: int) -> int:
        """The rank holding stage ``stage`` (ConfigError naming the stages when there is none)."""
        for r, held in enumerate(self.rank_stages):
            if stage in held:
                return r
        raise ConfigError(f"stage {stage!r} is not in this pipeline plan: its stages are 0..{self.num_stages - 1}")

    def for_stage(self, stage: int, module: Any = None) -> Plan:
        """Stage ``stage``'s part of its rank's plan: the decisions on that stage's modules, named as in the stage
        module (the ``stage<i>.`` prefix of an interleaved rank dropped), with the stage's fingerprint. The
        predicted peak and budget stay the rank's (every stage of a rank shares its memory).

        Raises:
            ConfigError: no such stage.
            PlanMismatchError: ``module`` given and it is not the module stage ``stage`` was planned for.
        """
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ConfigError(f"stage must be a stage index (int), got {stage!r:.60}")
        r = self.rank_of(stage)
        plan, fp = self.plans[r], self.stage_fingerprints[stage]
        if len(self.rank_stages[r]) > 1:
            root = f"stage{stage}"

            def local(fqn: str) -> str | None:  # the name in the stage module ("" for the stage itself), or None
                return "" if fqn == root else (fqn[len(root) + 1:] if fqn.startswith(root + ".") else None)

            plan = dataclasses.replace(
                plan,
                decisions=tuple(dataclasses.replace(d, fqn=local(d.fqn)) for d in plan.decisions if local(d.fqn) is not None),
                per_module_peak={local(k): v for k, v in plan.per_module_peak.items() if local(k) is not None},
                fingerprint=fp,
                meta={**plan.meta, "pipeline_stage": stage, "pipeline_rank": r},
            )
        if module is not None:
            from sacplan.fingerprint import model_fingerprint

            got = model_fingerprint(module)
            if fp and got != fp:
                raise PlanMismatchError(
                    f"this module is not pipeline stage {stage} of the plan (stage {stage}'s fingerprint is {fp}, the "
                    f"module's {got}); pass the stage index of this module: apply_plan(stage_module, plan, stage=i)"
                )
        return plan

    def summary(self) -> str:
        """One plan per stage (a rank's shared figures once per rank)."""
        out = [f"pipeline plan: {self.schedule}, {self.num_ranks} ranks, {self.num_stages} stages, "
               f"{self.microbatches} microbatches"]
        for r, (held, plan) in enumerate(zip(self.rank_stages, self.plans)):
            for i in held:
                out.append("")
                out.append(f"== stage {i} (rank {r}" + (f", with stages {[s for s in held if s != i]}" if len(held) > 1 else "") + ")")
                out.append(self.for_stage(i).summary())
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline": {"schedule": self.schedule, "microbatches": self.microbatches, "num_ranks": self.num_ranks,
                         "num_stages": self.num_stages, "stage_fingerprints": list(self.stage_fingerprints)},
            "ranks": [{"rank": r, "stages": list(h), "plan": p.to_dict()}
                      for r, (h, p) in enumerate(zip(self.rank_stages, self.plans))],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PipelinePlan":
        try:
            info = d["pipeline"]
            ranks = sorted(d["ranks"], key=lambda x: int(x["rank"]))
            out = cls(
                schedule=str(info["schedule"]), microbatches=int(info["microbatches"]), num_ranks=int(info["num_ranks"]),
                num_stages=int(info["num_stages"]), rank_stages=tuple(tuple(int(i) for i in x["stages"]) for x in ranks),
                plans=tuple(Plan.from_dict(x["plan"]) for x in ranks),
                stage_fingerprints=tuple(str(f) for f in info.get("stage_fingerprints", [""] * int(info["num_stages"]))),
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"invalid pipeline plan: {e}") from e
        if [int(x["rank"]) for x in ranks] != list(range(out.num_ranks)) or sorted(
                i for h in out.rank_stages for i in h) != list(range(out.num_stages)):
            raise PlanError("invalid pipeline plan: its ranks or stages are not 0..n-1, each once")
        if len(out.stage_fingerprints) != out.num_stages:
            raise PlanError("invalid pipeline plan: one stage fingerprint per stage expected")
        return out

    def save(self, path: Any) -> Any:
        """Write the versioned JSON file (module docstring) atomically; returns the path."""
        import datetime

        import torch

        import sacplan
        from sacplan.plan import write_plan_document

        doc = {"schema": SCHEMA, "version": PIPELINE_PLAN_FILE_VERSION, "sacplan_version": sacplan.__version__,
               "torch_version": torch.__version__,
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **self.to_dict()}
        return write_plan_document(path, doc)


def pipeline_document(doc: Any, where: str) -> PipelinePlan:
    """A :class:`PipelinePlan` from a parsed pipeline plan file (``where`` names it in errors)."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise PlanError(f"{where} is not a sacplan pipeline plan file (missing schema {SCHEMA!r})")
    v = doc.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PlanError(f"{where}: field 'version' must be an integer >= 1, got {v!r:.60}")
    if v > PIPELINE_PLAN_FILE_VERSION:
        raise PlanError(f"{where} has version {v}, newer than this sacplan supports ({PIPELINE_PLAN_FILE_VERSION}); upgrade sacplan")
    from sacplan.plan import PLAN_SCHEMA_VERSION, known_op
    from sacplan.plancheck import check_plan_body

    try:
        for k, rank in enumerate(doc.get("ranks") or []):  # every rank's plan is checked as a plan file's is
            body = rank.get("plan") if isinstance(rank, dict) else None
            if not isinstance(body, dict):
                raise PlanError(f"field 'ranks[{k}].plan' is missing or not an object")
            try:
                check_plan_body(body, known_op, PLAN_SCHEMA_VERSION)
            except PlanError as e:
                raise PlanError(f"ranks[{k}].plan: {e}") from None
        return PipelinePlan.from_dict(doc)
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None


def load_pipeline_plan(path: Any) -> PipelinePlan:
    """Read a file :meth:`PipelinePlan.save` wrote (``sacplan.load_plan`` reads it too)."""
    import json
    from pathlib import Path

    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PlanError(f"cannot read pipeline plan file {str(p)!r}: {e}") from e
    return pipeline_document(doc, f"pipeline plan file {str(p)!r}")


def solve_pipeline(stats: Sequence[ModelStats], budget: Any, **solve_kw: Any) -> PipelinePlan:
    """Plan every rank: ``sacplan.solve(ModuleTree(stats[r]), budget[r])`` (one budget for all ranks, or one per
    rank; same forms as ``solve``'s). ``solve_kw`` go to every ``solve``; ``fsdp_units`` defaults to each rank's
    own ``fully_shard`` units when it was collected on a mesh (``solve``'s default).

    Raises:
        ConfigError: stats not from :func:`~sacplan.pipeline.collect_pipeline`, or budgets not one per rank.
        InfeasibleBudgetError: a rank cannot meet its budget (the message names the rank).
    """
    from sacplan.errors import InfeasibleBudgetError
    from sacplan.solver import solve
    from sacplan.tree import ModuleTree

    infos = [s.meta.get("pipeline") if isinstance(s, ModelStats) else None for s in stats]
    if not infos or not all(infos):
        raise ConfigError("solve_pipeline needs the list of stats collect_pipeline returned (one per rank)")
    budgets = list(budget) if isinstance(budget, (list, tuple)) else [budget] * len(stats)
    if len(budgets) != len(stats):
        raise ConfigError(f"{len(budgets)} budgets for {len(stats)} ranks: give one budget, or one per rank")
    plans = []
    for r, (s, b) in enumerate(zip(stats, budgets)):
        try:  # fsdp_units by default: the rank's own fully_shard units (solve's default)
            plans.append(solve(ModuleTree(s), b, **solve_kw))
        except InfeasibleBudgetError as e:
            raise InfeasibleBudgetError(e.budget_bytes, e.min_feasible_bytes, f"(pipeline rank {r} of {len(stats)})") from e
    info = infos[0]
    return PipelinePlan(
        schedule=str(info["schedule"]), microbatches=int(info["microbatches"]), num_ranks=int(info["num_ranks"]),
        num_stages=int(info["num_stages"]), rank_stages=tuple(tuple(i["stages"]) for i in infos), plans=tuple(plans),
        stage_fingerprints=tuple(info.get("stage_fingerprints") or [""] * int(info["num_stages"])),
    )
