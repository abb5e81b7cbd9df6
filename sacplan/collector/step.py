"""Run the fake training step under the recorder: a warm-up step (creates optimizer state), then the recorded one.

The step runs inside, from outside in: Hugging Face configs without a key/value cache and the library's real
attention paths (:mod:`~sacplan.collector.hf`), a CUDA target's host kernels (:mod:`~sacplan.collector.kernels`),
FlexAttention routing with compilation off (:mod:`~sacplan.collector.flex`), fake mode, the real values of the
inputs for value-dependent reads and shapes (:mod:`~sacplan.collector.realvalues`), a CUDA target's attention
routing (:mod:`~sacplan.collector.attention`) and the :class:`~sacplan.collector.tracker.StepRecorder`. Parameter
and optimizer hooks re-label gradients and optimizer state and mark the optimizer step on the timeline. A failing step raises :class:`~sacplan.errors.CollectionError`
naming the module (and the aten op) that was running, with a remedy for that op (:mod:`~sacplan.collector.hints`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.collector.attention import FusedAttentionMode
from sacplan.collector.calling import Inputs, call_model
from sacplan.collector.hf import training_without_cache, transformers_real_paths
from sacplan.collector.flex import flex_attention_routed
from sacplan.collector.hints import failure_hint
from sacplan.collector.kernels import cuda_host_kernels, host_state_tensors
from sacplan.collector.moduleto import unchanged_module_to
from sacplan.collector.realvalues import HostFastPaths, RealValueMode
from sacplan.collector.records import BUFFER, GRAD, INPUT, OPT, OTHER, PARAM
from sacplan.collector.runtime import RuntimeModel
from sacplan.collector.tracker import StepRecorder
from sacplan.devices import DeviceSpec
from sacplan.errors import CollectionError, ConfigError, UnsupportedModelError
from sacplan.stats import Phase

#: ``(model, inputs, optimizer) -> Any``: a user's own training step (forward, backward, optimizer step).
TrainStep = Callable[[nn.Module, tuple, "torch.optim.Optimizer | None"], Any]


def run_step(
    fmodel: nn.Module,
    args: Inputs,
    loss: Callable[[Any, Inputs], torch.Tensor],
    opt: torch.optim.Optimizer | None,
    train_step: TrainStep | None,
    spec: DeviceSpec,
    rt: RuntimeModel,
    fake_mode: FakeTensorMode,
    real_inputs: Any,
    say: Callable[[str], None],
) -> StepRecorder:
    """Run the warm-up and the recorded step of ``fmodel`` on ``args`` (fakes) and return the recorder.

    Args:
        fmodel: the fake model (:func:`~sacplan.collector.materialise.build_fake_model`).
        args: the forward's arguments, fakes made in ``fake_mode``.
        loss: ``(output, inputs) -> scalar``, for the built-in step.
        opt: the optimizer of ``fmodel``'s trainable parameters (None: no optimizer step).
        train_step: the user's step replacing the built-in one (it then runs twice: warm-up and recorded).
        spec: the target device; rt: its runtime model.
        fake_mode: the mode ``fmodel`` and ``args`` were made in.
        real_inputs: the caller's real example inputs (None when a factory made them), so the fake step runs
            the attention paths the real one runs (:func:`~sacplan.collector.hf.transformers_real_paths`).
        say: progress callback.

    Raises:
        CollectionError: the step failed (CollectionError, ConfigError and UnsupportedModelError pass as they are).
    """
    recorder = StepRecorder(fmodel, spec, rt)
    hooks = _install_state_hooks(fmodel, opt, recorder, cuda_target=spec.attention == "flash")
    attention = FusedAttentionMode(lambda: setattr(recorder, "next_sdpa_random", True)) if spec.attention == "flash" else contextlib.nullcontext()
    host_kernels = cuda_host_kernels() if spec.attention == "flash" else contextlib.nullcontext()

    def builtin_step() -> None:
        out = call_model(fmodel, args)
        l = loss(out, args)
        del out
        recorder.close_segment(Phase.FW)
        l.backward()
        del l
        recorder.close_segment(Phase.BW)
        if opt is not None:
            with local_shard_step(opt):
                opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            fmodel.zero_grad(set_to_none=True)

    def user_step() -> None:
        train_step(fmodel, args, opt)  # type: ignore[misc]

    step = user_step if train_step is not None else builtin_step
    try:
        # transformers_real_paths: the library's value-dependent attention choices follow the real inputs,
        # so the fake step runs the kernels the real one runs (restored on exit).
        # values: data-dependent questions (.item(), mask sizes) answered from the real inputs
        values = RealValueMode(cuda_target=spec.attention == "flash")
        values.bind(args, real_inputs)
        # flex: FlexAttention runs the target's fused kernel, compiled functions run eagerly (never a compile)
        flex = flex_attention_routed(cuda_target=spec.attention == "flash")
        # unchanged_module_to: a Module.to() inside the forward that changes nothing (a router cast to its own dtype)
        with training_without_cache(fmodel), transformers_real_paths(real_inputs), host_kernels, flex, fake_mode, \
                values, HostFastPaths(values), attention, unchanged_module_to(), recorder:
            recorder.register(list(fmodel.parameters()), PARAM)
            recorder.register(list(fmodel.buffers()), BUFFER)
            recorder.register(args, INPUT)
            # the CUDA libraries' workspaces, live through the whole step (DeviceSpec.runtime_workspace_bytes)
            workspaces = torch.empty(spec.runtime_workspace_bytes, dtype=torch.uint8)
            if spec.runtime_workspace_bytes:
                recorder.register(workspaces, OTHER)
            say("warm-up step (creates optimizer state)")
            if train_step is not None:
                step()
            elif opt is not None:
                _warm_optimizer(fmodel, opt)
            recorder.close_segment()
            recorder.recording = True
            say("recorded step")
            step()
            recorder.close_segment(Phase.OTHER)
            recorder.recording = False
    except (CollectionError, ConfigError, UnsupportedModelError):
        raise
    except Exception as e:  # name the module that was running
        if recorder.failed_in is not None and recorder.failed_in[1] is e:
            where = recorder.failed_in[0]  # the forward hooks have unwound fw_stack by now
        else:
            where = recorder.fw_stack[-1].fqn if recorder.fw_stack else (recorder.bw_active[-1].fqn if recorder.bw_active else "")
        op = recorder.failed_op[0] if recorder.failed_op is not None and _caused_by(e, recorder.failed_op[1]) else None
        module = _submodule(fmodel, where)
        raise CollectionError(
            f"the fake training step failed in module {where or '<top level>'!r} ({type(fmodel).__name__}"
            f"{f'.{where}: {type(module).__name__}' if where and module is not None else ''})"
            f"{f' at {op}' if op is not None else ''}: {type(e).__name__}: {e}. {failure_hint(op, e, module)}"
        ) from e
    finally:
        for h in hooks:
            h.remove()
    return recorder


def _warm_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Create optimizer state without a forward/backward: zero grads, one step, grads dropped."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    with local_shard_step(opt):
        opt.step()
    opt.zero_grad(set_to_none=True)


@contextlib.contextmanager
def local_shard_step(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, the optimizer steps DTensor parameters (a mesh) through their local shards.

    Where every gradient of a parameter group has its parameter's placements, the updates are elementwise on
    matching shards, so a rank allocates exactly what the same step on its local tensors allocates; DTensor
    dispatch only adds sharding propagation, which for foreach ops runs over all their tensors on every first call
    (15.6 s of a 37 s Llama-70B TP 8 x FSDP 8 collection). Each DTensor parameter of such a group is replaced by a
    Parameter on its local tensor (same storage) carrying the local gradient, and its state moves to it and back
    as local tensors. A group with a gradient placed otherwise (TP's replicated output-layer gradient) steps as
    DTensors, where DTensor redistributes it, its state wrapped back into DTensors (same storage).
    """
    swaps: list[tuple[dict, list[Any]]] = []
    pairs: list[tuple[Any, Any]] = []
    for group in opt.param_groups:
        params = group["params"]
        dts = [p for p in params if _is_dtensor(p)]
        if not dts:
            continue
        local_ok = all(p.grad is None or (_is_dtensor(p.grad) and p.grad.placements == p.placements
                                          and p.grad._local_tensor.shape == p._local_tensor.shape) for p in dts)
        for p in dts:
            _state_as(opt.state.get(p), p, local=local_ok)
        if not local_ok:
            continue
        local = []
        for p in params:
            if not _is_dtensor(p):
                local.append(p)
                continue
            lp = nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
            lp.grad = None if p.grad is None else p.grad._local_tensor
            if p in opt.state:
                opt.state[lp] = opt.state.pop(p)
            pairs.append((p, lp))
            local.append(lp)
        swaps.append((group, params))
        group["params"] = local
    try:
        yield
    finally:
        for group, params in swaps:
            group["params"] = params
        for p, lp in pairs:
            if lp in opt.state:
                opt.state[p] = opt.state.pop(lp)


def _state_as(state: Any, p: Any, local: bool) -> None:
    """Parameter ``p``'s optimizer state as local shards (``local``) or as DTensors like ``p`` (same storages)."""
    if not isinstance(state, dict):
        return
    from torch.distributed.tensor import DTensor

    for k, v in state.items():
        if local and _is_dtensor(v) and v.placements == p.placements:
            state[k] = v._local_tensor
        elif not local and isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.shape == p._local_tensor.shape and v.dim():
            state[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def _install_state_hooks(
    model: nn.Module, opt: torch.optim.Optimizer | None, rec: StepRecorder, cuda_target: bool = False
) -> list[Any]:
    handles = []
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda p: rec.relabel(p.grad, GRAD)))
    if opt is not None:

        def pre(o: Any, args: Any, kwargs: Any) -> None:
            rec.close_segment(Phase.BW if not rec.in_optimizer else Phase.OTHER)
            rec.in_optimizer = True

        def post(o: Any, args: Any, kwargs: Any) -> None:
            for state in o.state.values():
                rec.relabel([v for v in state.values() if isinstance(v, torch.Tensor)], OPT)
            if cuda_target:
                rec.untrack(host_state_tensors(o))
            rec.close_segment(Phase.OTHER)
            rec.in_optimizer = False

        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    return handles


def _caused_by(e: BaseException, cause: BaseException) -> bool:
    """True when ``cause`` is ``e`` or in its chain of causes / contexts."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if cur is cause:
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _submodule(model: nn.Module, fqn: str) -> nn.Module | None:
    """The module named ``fqn`` in ``model`` (``""``: the model itself); None when there is none."""
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None
