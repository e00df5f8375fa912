"""Reading compiled HLO (dpbook.jax.hlo): GPU-style asynchronous collectives and command
buffers, from fixture text (tests/fixtures/hlo/), and the CPU backend's own output.

The main fixture is one small scheduled module in two spellings: ``gpu_step.hlo`` as XLA
prints it (``%`` names, an asynchronous reduce-scatter as ``reduce-scatter-start``), and
``gpu_step_async.hlo`` with the reduce-scatter in a generic ``async-start`` wrapper
(``calls=``), names without ``%``, operand shapes, some instructions over several lines.
``async_call.hlo`` calls a computation asynchronously. All parse with XLA's own HLO
parser (checked below where jaxlib exposes it).
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dpbook.jax import hlo
from dpbook.jax.state import AXIS, make_mesh

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hlo"
STEP = (FIXTURES / "gpu_step.hlo").read_text()
STEP_ASYNC = (FIXTURES / "gpu_step_async.hlo").read_text()
# An asynchronous call of a computation that is not a collective, in XLA's generic form
# (XLA prints it `call-start` / `call-update` / `call-done`).
ASYNC_CALL = (FIXTURES / "async_call.hlo").read_text()
BOTH = pytest.mark.parametrize("text", [STEP, STEP_ASYNC], ids=["sugared", "async-start"])

# What the fixture module computes: an all-gather of a weight shard f32[16,32] into
# f32[64,32]; a reduce-scatter of its gradient back to f32[16,32]; one all-reduce of a
# bias gradient and the loss; a collective-permute of f32[16].
RESULTS = [("all-gather", "f32[64,32]"), ("reduce-scatter", "f32[16,32]"),
           ("all-reduce", "(f32[64], f32[])"), ("collective-permute", "f32[16]")]


@BOTH
def test_async_collectives_report_their_results(text):
    assert hlo.parse_collectives(text) == RESULTS


@BOTH
def test_an_async_pair_counts_once(text):
    assert len(re.findall(r"-start\(", text)) == 4 == len(re.findall(r"-done\(", text))
    kinds = Counter(kind for kind, _ in hlo.parse_collectives(text))
    assert kinds == {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1,
                     "collective-permute": 1}


@BOTH
def test_type_bytes_counts_results_only(text):
    nbytes = sum(hlo.type_bytes(result) for _, result in hlo.parse_collectives(text))
    assert nbytes == 4 * (64 * 32 + 16 * 32 + 64 + 1 + 16)
    # the start instructions' own types hold the operands as well, and context words
    starts = re.findall(r"= (.*?) (?:all-gather|collective-permute|all-reduce)-start\(",
                        text)
    assert sum(map(hlo.type_bytes, starts)) == 4 * (16 * 32 + 64 * 32) + 4 * (64 + 1) \
        + 4 * (16 + 16) + 2 * 4


def test_results_read_from_start_tuples_without_a_done():
    text = """
  %ag = (f32[8]{0}, f32[32]{0}) all-gather-start(f32[8]{0} %p)
  %cp = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p)
  %rs = ((f32[32]{0}), f32[8]{0}) reduce-scatter-start(%q), dimensions={0}
  %ar = (f32[8]{0}, f32[4]{0}) all-reduce-start(%p, %r), to_apply=%add
  %a2a = ((bf16[8,4]{1,0}), bf16[8,4]{1,0}, u32[]{:S(2)}) all-to-all-start(%s)
"""
    assert hlo.parse_collectives(text) == [
        ("all-gather", "f32[32]"), ("collective-permute", "f32[8]"),
        ("reduce-scatter", "f32[8]"), ("all-reduce", "(f32[8], f32[4])"),
        ("all-to-all", "bf16[8,4]")]


def test_the_done_decides_the_result():
    # not valid HLO (the types disagree): it tells which of the two is read
    text = """
  %ag = (f32[8]{0}, f32[32]{0}) all-gather-start(f32[8]{0} %p)
  %ag.1 = f32[4,8]{1,0} all-gather-done(%ag)
"""
    assert hlo.parse_collectives(text) == [("all-gather", "f32[4,8]")]


@BOTH
def test_schedule_reads_the_command_buffer_at_its_call_site(text):
    rows = hlo.parse_schedule(text)
    names = [name for name, _, _ in rows]
    assert names[:8] == ["param", "param.1", "param.2", "param.3",   # the entry's
                         "all-gather-start", "all-gather-done", "dot_fusion", "tuple"]
    assert names[8:10] == ["get-tuple-element", "get-tuple-element.1"]
    opcodes = [opcode for _, opcode, _ in rows]
    assert "call" not in opcodes and "p" not in names and "p.1" not in names
    assert len(rows) == 24
    assert dict((name, phase) for name, _, phase in rows if name.endswith("fusion")) == {
        "dot_fusion": "forward", "loss_fusion": "forward", "grad_w_fusion": "backward",
        "grad_x_fusion": "backward", "grad_b_fusion": "backward", "update_fusion": "other"}
    assert [opcode for _, opcode, phase in rows if phase == "collective"] == [
        "all-gather-start", "all-gather-done", "reduce-scatter-start", "all-reduce-start",
        "collective-permute-start", "reduce-scatter-done", "all-reduce-done",
        "collective-permute-done"]
    phases = [phase for _, _, phase in rows]
    overlap = phases[opcodes.index("reduce-scatter-start"):
                     opcodes.index("reduce-scatter-done")]
    assert overlap.count("backward") == 2          # backward work while it is in flight


def test_both_spellings_give_the_same_schedule():
    assert hlo.parse_schedule(STEP) == hlo.parse_schedule(STEP_ASYNC)
    assert "async-start(" in STEP_ASYNC and "async-start(" not in STEP


def test_an_async_call_is_read_at_its_start():
    assert hlo.parse_schedule(ASYNC_CALL) == [
        ("a", "parameter", "other"), ("b", "parameter", "other"),
        ("negate", "negate", "backward"), ("multiply", "multiply", "backward"),
        ("sine", "sine", "forward"), ("add", "add", "other")]
    assert hlo.parse_collectives(ASYNC_CALL) == []


def _xla_printer():
    try:
        from jax._src.lib import xla_client
        return xla_client.hlo.hlo_module_from_text, xla_client.hlo.HloPrintOptions
    except (ImportError, AttributeError):
        return None


@pytest.mark.skipif(_xla_printer() is None, reason="this jaxlib exposes no HLO text parser")
@pytest.mark.parametrize("text", [STEP, STEP_ASYNC, ASYNC_CALL],
                         ids=["sugared", "async-start", "async-call"])
def test_what_xla_prints_parses_the_same(text):
    """XLA's parser accepts the fixture, and what XLA's printer makes of it (with ``%``
    names, and without, with operand shapes) parses to the same collectives and schedule."""
    from_text, options = _xla_printer()
    module = from_text(text)
    bare = options()
    bare.print_percent, bare.print_operand_shape = False, True
    for printed in (module.to_string(), module.to_string(bare)):
        assert hlo.parse_collectives(printed) == hlo.parse_collectives(text)
        assert hlo.parse_schedule(printed) == hlo.parse_schedule(text)
    if text is ASYNC_CALL:                  # the one-instruction wrapper, printed as such
        assert "call-start(" in module.to_string()
    if text is STEP_ASYNC:                  # a wrapper of two instructions stays generic
        assert "async-start(" in module.to_string()


# --- The CPU backend -----------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_program():
    mesh = make_mesh(jax.devices()[:4])
    w = jax.device_put(np.ones((10, 3), np.float32), NamedSharding(mesh, P()))
    x = jax.device_put(np.ones((8, 10), np.float32), NamedSharding(mesh, P(AXIS)))
    grad = jax.jit(jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)))
    gather = jax.jit(lambda x: 2 * x, out_shardings=NamedSharding(mesh, P()))
    return grad, gather, w, x


def test_cpu_collectives(cpu_program):
    grad, gather, w, x = cpu_program
    [(kind, result)] = hlo.collectives(grad, w, x)     # the gradient's cross-device sum
    assert kind == "all-reduce" and hlo.type_bytes(result) == 4 * 10 * 3
    assert hlo.collectives(gather, x) == [("all-gather", "f32[8,10]")]
    assert hlo.collective_ops(grad, w, x) == {"all-reduce": 1}
    assert hlo.allreduce_ops(grad, w, x) == [result]
    assert hlo.parse_collectives(hlo.compiled_text(grad, w, x)) == [(kind, result)]


def test_cpu_schedule(cpu_program):
    grad, _, w, x = cpu_program
    text = hlo.compiled_text(grad, w, x)
    rows = hlo.schedule(grad, w, x)
    assert rows == hlo.parse_schedule(text)
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    assert [name for name, _, _ in rows] == re.findall(r"\n\s*(?:ROOT )?%(\S+) = ", entry)
    phases = [phase for _, _, phase in rows]
    assert [opcode for _, opcode, phase in rows if phase == "collective"] == ["all-reduce"]
    assert "forward" in phases[:phases.index("backward")]
    assert "backward" in phases[:phases.index("collective")]
