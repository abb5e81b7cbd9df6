"""Models fake tensors alone cannot collect (issue 24 item 4): predicted vs measured on real CPU steps.

* a CTC head that reads ``labels.max()``, selects targets by boolean mask and calls ``ctc_loss`` with tensor
  lengths (values answered from the real labels, ``sacplan/collector/realvalues.py``);
* transformers' ``Wav2Vec2ForCTC`` at a tiny config (``layerdrop = 0.0``: its random layer skipping cannot be
  planned; collection says so).

Each: collect for this host -> solve at three budgets (near the minimum feasible, midway, the no-checkpointing
peak) -> ``validate`` on a real CPU step (peak, recomputed FLOPs, gradients). FlexAttention has no CPU backward,
so it is not here (its collection for a CUDA target is checked in tests/collector/test_flex.py).

Usage: ``python3 benchmarks/fakes_cannot_answer.py``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "conformance"))
import conftest  # noqa: E402,F401  (torchvision schemas: transformers imports it)

from sacplan.collector import collect  # noqa: E402
from sacplan.devices import CPU  # noqa: E402
from sacplan.solver import min_feasible_budget, solve  # noqa: E402
from sacplan.tree import ModuleTree  # noqa: E402
from sacplan.units import Bytes  # noqa: E402
from sacplan.validation import validate  # noqa: E402


def _ctc_head():
    from tests.collector.test_realvalues import CtcHead, ctc_inputs

    return CtcHead, lambda: ctc_inputs(), lambda out: out


def _wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    def build():
        cfg = Wav2Vec2Config(
            vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0, pad_token_id=0,
        )
        return Wav2Vec2ForCTC(cfg)

    def inputs():
        g = torch.Generator().manual_seed(0)
        labels = torch.randint(1, 16, (2, 12), generator=g)
        labels[1, 9:] = -100
        return {"input_values": torch.randn(2, 1600, generator=g), "labels": labels}

    return build, inputs, lambda out: out.loss


def main() -> None:
    print("| model | budget | predicted peak | measured peak | error | recomputed FLOPs | gradients | collect s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, case in (("CTC head (labels.max(), mask, tensor lengths)", _ctc_head), ("Wav2Vec2ForCTC", _wav2vec2)):
        build, inputs, loss = case()
        torch.manual_seed(0)
        t0 = time.perf_counter()
        tree = ModuleTree(collect(build, inputs(), device=CPU, loss_fn=loss, optimizer=False))
        seconds = time.perf_counter() - t0
        lo, hi = int(min_feasible_budget(tree)), int(tree.stats.peak_bytes)
        for label, budget in (("near-min", lo + (hi - lo) // 50), ("midway", (lo + hi) // 2), ("no-AC peak", hi)):
            plan = solve(tree, Bytes(budget), gap_rel=0.02, time_limit_s=10)
            rep = validate(build, inputs, plan, loss_fn=loss, optimizer=False, device="cpu", timed_steps=1)
            flops = "exact" if rep.measured_recompute_flops == rep.predicted_recompute_flops else "differ"
            print(f"| {name} | {label} | {rep.predicted_peak_bytes} | {rep.planned.peak_bytes} | "
                  f"{rep.peak_error:+.2%} (tracker on real tensors {rep.planned.tracker_peak_bytes}) | {flops} | {'bitwise' if rep.grads_bitwise_equal else 'DIFFER'} | "
                  f"{seconds:.1f} |")


if __name__ == "__main__":
    main()
