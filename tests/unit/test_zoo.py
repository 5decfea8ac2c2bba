"""The model zoo (benchmarks/zoo/): nine models of different shapes, each counted as by hand.

FLOPs per sample are what MFU and every prediction on a GPU start from; on a model nobody here wrote
torch's counter missed whole kernels (CPU attention, grouped matmuls) without a word. Each zoo
model's counted FLOPs must agree with its hand count (issue 40's bar: within 5%), with no op that
multiplies left uncounted.
"""

from __future__ import annotations

import pytest

from benchmarks.zoo import ZOO, workload
from core.flops import sample_flops

TOLERANCE = 0.05


def test_the_zoo_holds_nine_shapes():
    shapes = " ".join(m.shape for m in ZOO.values())
    assert len(ZOO) >= 9
    for kind in ("GPT-lite", "decoder", "encoder", "vision transformer", "BatchNorm", "mixture of experts",
                 "recurrent", "frozen and tied", "convolutional front end"):
        assert kind in shapes, kind


@pytest.mark.parametrize("name", list(ZOO))
def test_flops_per_sample_are_the_hand_count(name):
    model = ZOO[name]
    w = workload(model)
    flops = sample_flops(w, None, 0)
    hand = model.hand(getattr(w.data, "vocab_size", None))
    assert flops["uncounted"] == [], f"{name}: ops that multiply without a formula: {flops['uncounted']}"
    assert abs(flops["counted"] / hand - 1) <= TOLERANCE, (name, flops["counted"], hand, flops["counted"] / hand)
