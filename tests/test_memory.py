"""Activation memory (dpbook.sharding's activation formulas, dpbook.torch.memory): the
formulas (attention scores stored or fused) and their errors, the memory timeline of a
step (its phases, its maximum the peak), the measured peak against the model within the
page's factor, checkpointing equal to no checkpointing (parameters, BatchNorm buffers,
eval outputs), and the checked exercise on an MLP's activations."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F
from torch.profiler import record_function

from dpbook import sharding
from dpbook.torch import exercises, memory, models

# the page's factor: measured peak / (modelled activations + gradients) in [1/1.5, 1.5]
FACTOR = 1.5


def test_transformer_formula_is_korthikanti_and_checkpointing_keeps_layer_inputs():
    s, b, h, a, L = 2048, 2, 1024, 16, 4
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert sharding.transformer_activation_bytes(s, b, h, a, L) == pytest.approx(L * per_layer)
    full = sharding.transformer_activation_bytes(s, b, h, a, L, checkpoint=True)
    assert full == pytest.approx(L * 2 * s * b * h + per_layer)
    # linear in the batch
    assert sharding.transformer_activation_bytes(s, 2 * b, h, a, L) == pytest.approx(
        2 * L * per_layer)
    assert sharding.activation_bytes(100, 8, 2) == 1600
    assert type(sharding.activation_bytes(100, 8)) is int       # as annotated: bytes


def test_fused_attention_drops_exactly_the_score_matrices():
    # by hand: s·b·h = 2048·2·1024 = 4,194,304; 34 of them per layer, 4 layers
    s, b, h, a, L = 2048, 2, 1024, 16, 4
    flash = sharding.transformer_activation_bytes(s, b, h, a, L, flash=True)
    assert flash == 4 * 34 * 4_194_304 == 570_425_344
    scores = 5 * a * s * s * b                 # 5·16·2048²·2 = 671,088,640 per layer
    assert sharding.transformer_activation_bytes(s, b, h, a, L) - flash == L * scores
    # checkpointed: 4 layer inputs of 2·s·b·h, plus one layer recomputed (34·s·b·h)
    assert sharding.transformer_activation_bytes(
        s, b, h, a, L, checkpoint=True, flash=True) == (4 * 2 + 34) * 4_194_304
    # the 7B example: 34·4096·4096·32 bytes, and stage 3 then fits 24 GB and 80 GB devices
    act = sharding.transformer_activation_bytes(4096, 1, 4096, 32, 32, flash=True)
    assert act == 18_253_611_008
    assert sharding.devices_to_fit(7_000_000_000, 24e9, 3, "mixed", activations=act) == 20
    assert sharding.devices_to_fit(7_000_000_000, 80e9, 3, "mixed", activations=act) == 2


def test_devices_to_fit_counts_activations():
    seven_b = 7_000_000_000
    assert sharding.devices_to_fit(seven_b, 24e9, 3, "mixed") == 5        # state only
    act = sharding.transformer_activation_bytes(4096, 1, 4096, 32, 32)
    assert act > 100e9
    assert sharding.devices_to_fit(seven_b, 24e9, 3, "mixed", activations=act) is None
    ckpt = sharding.transformer_activation_bytes(4096, 1, 4096, 32, 32, checkpoint=True)
    assert sharding.devices_to_fit(seven_b, 24e9, 3, "mixed", activations=ckpt) == 6


@pytest.mark.parametrize("call, message", [
    (lambda: sharding.activation_bytes(-1, 2), "values_per_example"),
    (lambda: sharding.activation_bytes(10, 2.5), "batch"),
    (lambda: sharding.transformer_activation_bytes(0, 1, 64, 4, 2), "seq_len"),
    (lambda: sharding.transformer_activation_bytes(8, 1, 65, 4, 2), "divide"),
    (lambda: sharding.devices_to_fit(10, 100, 3, activations=-1), "activations"),
])
def test_bad_input_says_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("name", ["lenet", "resnet18"])
def test_peak_within_factor_of_model(name):
    torch.manual_seed(0)
    net = models.lenet() if name == "lenet" else models.resnet18(width=8)
    values = memory.layer_output_values(net, torch.zeros(1, 1, 28, 28))
    grads = 4 * models.num_params(net)
    for b in (2, 16):
        X, y = torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))
        peak = memory.step_peak(net, X, y)
        model = sharding.activation_bytes(values, b) + grads
        assert 1 / FACTOR <= peak / model <= FACTOR, (b, peak, model)
        saved = memory.saved_bytes(net, X, y)
        assert 0 < saved <= peak


def test_lenet_saved_bytes_are_exact():
    # input 784, ReLU outputs 13,520 / 4,050 / 128, pooled 3,380 / 800, log-softmax 10,
    # int64 targets (2 float32 values), the loss's scalar weight
    net, b = models.lenet(), 4
    X, y = torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))
    assert memory.saved_bytes(net, X) == 4 * b * (784 + 13_520 + 3_380 + 4_050 + 800 + 128)
    assert memory.saved_bytes(net, X, y) == 4 * b * (22_662 + 10 + 2) + 4


def test_checkpointing_equals_no_checkpointing_and_saves_memory():
    torch.manual_seed(0)
    net = models.resnet18(width=8)
    ckpt = memory.checkpoint_blocks(net)
    assert sum(isinstance(m, memory.Checkpointed) for m in ckpt.modules()) == 8
    batches = [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))) for _ in range(3)]
    X, y = batches[0]
    assert memory.step_peak(ckpt, X, y) < memory.step_peak(net, X, y)
    plain = memory.train_sgd(copy.deepcopy(net), batches)
    ckpt = memory.train_sgd(ckpt, batches)
    # the same kernels on the same inputs: bitwise equal on the CPU, parameters and
    # buffers (BatchNorm's running statistics, num_batches_tracked: the recomputation
    # must not update them a second time)
    want, got = plain.state_dict(), ckpt.state_dict()
    assert [k.replace(".block.", ".") for k in got] == list(want)
    assert all(torch.equal(p, q) for p, q in zip(want.values(), got.values()))
    assert want["3.0.bn1.num_batches_tracked"] == len(batches) + 1   # + step_peak's step
    plain.eval(), ckpt.eval()
    with torch.no_grad():
        assert torch.equal(plain(X), ckpt(X))


def test_memory_timeline_marks_the_phases_and_its_maximum_is_the_peak():
    torch.manual_seed(0)
    net = models.lenet()
    X, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def step():
        with record_function("forward"):
            loss = F.cross_entropy(net(X), y)
        with record_function("backward"):
            loss.backward()

    t = memory.memory_timeline(step, ("forward", "backward"))
    (f0, f1), (b0, b1) = t.phases["forward"], t.phases["backward"]
    assert 0 == f0 < f1 <= b0 < b1 <= len(t.allocated) == len(t.seconds)
    assert t.seconds == sorted(t.seconds)
    # LeNet keeps its activations through the forward pass; the peak comes after it,
    # and once backward has freed them only the gradients (4 bytes a parameter) remain
    peak = max(t.allocated)
    assert b0 <= t.allocated.index(peak) < b1
    assert t.allocated[-1] == 4 * models.num_params(net)
    net.zero_grad(set_to_none=True)
    assert memory.peak_bytes(step) == peak
    # leaving out the small events keeps the values of the others
    net.zero_grad(set_to_none=True)
    big = memory.memory_timeline(step, ("backward",), min_bytes=1000)
    assert len(big.allocated) < len(t.allocated) and set(big.allocated) <= set(t.allocated)
    with pytest.raises(ValueError, match="step"):
        memory.memory_timeline(lambda: None, ("step",))


def test_peak_bytes_rejects_other_devices():
    with pytest.raises(ValueError, match="cpu"):
        memory.peak_bytes(lambda: None, "meta")


def right_mlp(widths, batch):
    return 4 * batch * (widths[0] + sum(widths[1:-1]))


@pytest.mark.parametrize("wrong, hint", [
    (lambda w, b: 4 * b * (w[0] + 2 * sum(w[1:-1]) + w[-1]), "mlp-saved-count"),
    (lambda w, b: 4 * b * sum(w[1:-1]), "mlp-saved-input"),
    (lambda w, b: 4 * (w[0] + sum(w[1:-1])), "mlp-saved-batch"),
])
def test_mlp_exercise(wrong, hint):
    assert exercises.check_mlp_activations(right_mlp, quiet=True) is None
    failure = exercises.check_mlp_activations(wrong, quiet=True)
    assert failure is not None and failure.hint == hint


def test_measuring_prints_nothing(capfd):
    """The profiler's C++ side prints a profiler_start/stop line on every start (a stored
    page once showed nine of them); peak_bytes keeps them off the page."""
    model = models.lenet()
    X = torch.rand(2, 1, 28, 28)
    assert memory.peak_bytes(lambda: model(X).sum().backward(), "cpu") > 0
    out, err = capfd.readouterr()
    assert "profiler_start" not in out + err
