"""FSDP in JAX by sharding alone: place the training state across the devices, jit the
single-device step, and let XLA insert the collectives.

The concise chapter's ``jit`` method replicates the state (``P()``) and splits the batch
(``P(AXIS)``); XLA then sums the gradients with one all-reduce. Here each array of the
state (parameters and Adam's moments) is split along the same axis as the batch
(:func:`fsdp_spec`: its largest dimension that divides by the number of devices; an array
with none stays replicated, like small biases), and the step is the same function, jitted
with those shardings in and out. XLA's partitioner then gathers each parameter where the
computation needs it whole and hands each device only its slice of the new state. The
mesh's axis is *Auto* (the partitioner chooses), not Explicit as in :func:`dpbook.jax.state.make_mesh`.

That gives ZeRO-3's *storage*: between steps each device holds about 1/N of the state. It
does not give ZeRO-3's *schedule* inside the step (gather a layer's parameters, use them,
free them, gather them again for the backward pass): XLA may keep a gathered parameter
alive from the forward into the backward pass, and it places the all-gathers where its
scheduler likes. :class:`RematLeNet` puts each hidden layer under ``nn.remat`` (Flax's
``jax.checkpoint``), so that the backward pass recomputes the layer and gathers its
parameters again; :func:`gathered_params` reads from the compiled program which whole
parameters exist and for how long.
"""
from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from . import hlo
from .state import AXIS, TrainState, loss_fn

__all__ = ["make_auto_mesh", "fsdp_spec", "state_shardings", "create_adam_state",
           "train_step", "make_step", "bytes_per_device", "RematLeNet", "Whole",
           "gathered_params", "parse_gathered_params"]


def make_auto_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh named ``AXIS`` over ``devices`` whose axis XLA's partitioner handles."""
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Auto,),
                         devices=devices)


def fsdp_spec(shape: Sequence[int], num_devices: int) -> P:
    """Shard the largest dimension of ``shape`` that ``num_devices`` divides; ``P()``
    (replicated) if none does.

    >>> [tuple(fsdp_spec(shape, 4)) for shape in ((800, 128), (5, 5, 20, 50), (10,))]
    [('devices', None), (None, None, 'devices', None), ()]
    """
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[d] % num_devices == 0:
            return P(*(AXIS if i == d else None for i in range(len(shape))))
    return P()


def state_shardings(state, mesh: Mesh, fsdp: bool = True):
    """A ``NamedSharding`` for every leaf of ``state``: :func:`fsdp_spec` with ``fsdp``,
    replicated (plain data parallelism) without."""
    n = mesh.shape[AXIS]
    return jax.tree.map(
        lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), n) if fsdp else P()), state)


def create_adam_state(model, key: jax.Array, lr: float = 1e-3,
                      input_shape: Sequence[int] = (1, 28, 28, 1)) -> TrainState:
    """``model`` initialized from ``key`` with ``optax.adam(lr)``: two moments per
    parameter, the state that sharding is for."""
    variables = jax.jit(model.init)(key, jnp.ones(input_shape, jnp.float32))
    state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                              tx=optax.adam(lr), batch_stats=variables.get("batch_stats"))
    return state.replace(step=jnp.asarray(state.step))     # an array, so it can be placed


def train_step(state: TrainState, X, y):
    """The single-device step (the concise chapter's ``jit_train_step``): no collectives."""
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state, X, y)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


def make_step(mesh: Mesh, state, fsdp: bool = True) -> Callable:
    """:func:`train_step` jitted for ``state`` sharded (``fsdp``) or replicated on ``mesh``
    and a batch split along ``AXIS``; the new state keeps the same shardings."""
    shardings, split = state_shardings(state, mesh, fsdp), NamedSharding(mesh, P(AXIS))
    return jax.jit(train_step, in_shardings=(shardings, split, split),
                   out_shardings=(shardings, NamedSharding(mesh, P())))


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes of ``tree``'s arrays that each device holds (device id → bytes), summed over
    the shards placed on it."""
    out: dict[int, int] = {}
    for a in jax.tree.leaves(tree):
        for shard in a.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


class RematLeNet(nn.Module):
    """:class:`dpbook.jax.models.LeNet` with each hidden layer (convolution or dense, its
    ReLU and pooling) under ``nn.remat``, Flax's ``jax.checkpoint``: JAX keeps only each
    layer's input for the backward pass, which computes the layer again (where XLA then
    schedules that work is its own choice). The parameters have LeNet's names and shapes,
    so one state runs either model.

    ``policy``, a ``jax.checkpoint_policies`` function, says which values inside a layer
    the forward pass keeps as well: ``nothing_saveable`` none (the same as the default,
    None), ``dots_saveable`` the outputs of its matrix products and convolutions,
    ``everything_saveable`` all of them, as without ``remat``."""
    num_classes: int = 10
    policy: Callable | None = None

    @nn.compact
    def __call__(self, x):                                   # (B, 28, 28, 1)
        def conv(layer, x):                                  # convolution, ReLU, pooling
            return nn.avg_pool(nn.relu(layer(x)), (2, 2), strides=(2, 2))

        def dense(layer, x):
            return nn.relu(layer(x))

        conv = nn.remat(conv, policy=self.policy)            # recomputed in backward,
        dense = nn.remat(dense, policy=self.policy)          # except what policy saves
        x = conv(nn.Conv(20, (3, 3), padding="VALID"), x)    # (B, 13, 13, 20)
        x = conv(nn.Conv(50, (5, 5), padding="VALID"), x)    # (B, 4, 4, 50)
        x = dense(nn.Dense(128), x.reshape((x.shape[0], -1)))
        return nn.Dense(self.num_classes)(x)                 # the last layer: no ReLU


class Whole(NamedTuple):
    """A whole parameter inside a compiled step (see :func:`gathered_params`)."""
    shape: tuple
    opcode: str          # 'all-gather', or the instruction that copied one
    first: int           # its position in the schedule
    last: int            # the position of its last reader
    nbytes: int
    phase: str           # the phase of its last reader: 'forward', 'backward', ...


def gathered_params(jitted: Callable, shapes, *args) -> list[Whole]:
    """The whole parameters inside the program compiled for ``jitted(*args)``, in the
    order of XLA's schedule of the entry computation.

    A whole parameter is the result of an ``all-gather`` whose shape is in ``shapes``
    (the parameters' shapes; the transpose of a matrix counts), or a copy of one (an
    instruction with as many elements whose one operand is one, e.g. a change of layout).
    It is alive from its position in the schedule to that of its last reader: the
    entry computation's instructions, in order, which is the schedule (on a GPU a
    command buffer, a called computation, counts as one position: its gathered arrays
    are whole from the call on; see :func:`parse_gathered_params`).
    """
    return parse_gathered_params(hlo.compiled_text(jitted, *args), shapes)


def parse_gathered_params(text: str, shapes) -> list[Whole]:
    """:func:`gathered_params` for the text of a compiled HLO module.

    It reads a gather in the three forms XLA prints: an ``all-gather`` (the CPU
    backend); an asynchronous pair, whose ``all-gather-done`` (or the ``async-done`` of
    an all-gather) holds the whole array from its ``-start`` on (GPUs); and a gather
    inside a called computation (a GPU command buffer), whose whole arrays leave the
    call as elements of its tuple, taken out by ``get-tuple-element``. A gather of
    several arrays at once returns a tuple, read the same way.
    """
    shapes = {tuple(s) for s in shapes} | {tuple(s)[::-1] for s in shapes}
    computations, entry = hlo._module(text)
    pairs = hlo._Async(computations)

    def is_gather(i) -> bool:
        return i.opcode == "all-gather" or (
            i.opcode.endswith("-done") and pairs.kind.get(i) == "all-gather")

    def whole_elements(i) -> set[int]:
        """The elements of ``i``'s tuple result that are whole parameters."""
        parts = hlo._split(hlo._clean(i.type)[1:-1]) if i.type.startswith("(") else []
        if is_gather(i):
            return {j for j, t in enumerate(parts) if _dims(t) in shapes}
        called = computations.get(i.attr("to_apply") or i.attr("calls") or "", [])
        root = next((c for c in called if c.root), None)
        if i.opcode != "call" or root is None or root.opcode != "tuple":
            return set()
        inner = {c.name: c for c in called}
        return {j for j, o in enumerate(root.operands) if o in inner
                and is_gather(inner[o]) and _dims(hlo._clean(inner[o].type)) in shapes}

    body = computations[entry]
    position = {i.name: k for k, i in enumerate(body)}
    alive: dict[str, list] = {}                   # name -> [result, opcode, first, last]
    tuples: dict[str, set[int]] = {}              # a tuple holding whole parameters
    for k, i in enumerate(body):
        result = hlo._clean(i.type)
        whole = [o for o in i.operands if o in alive]
        for o in whole:
            alive[o][3] = k
        if result.startswith("("):
            if elements := whole_elements(i):
                tuples[i.name] = elements
            continue
        index = re.search(r"\bindex=(\d+)", i.attrs)
        if is_gather(i) and _dims(result) in shapes:
            start = pairs.start.get(i)                # an async pair: whole from its start
            first = position.get(start.name, k) if start is not None else k
            alive[i.name] = [result, "all-gather", first, k]
        elif (i.opcode == "get-tuple-element" and i.operands and i.operands[0] in tuples
              and index and int(index[1]) in tuples[i.operands[0]]):
            alive[i.name] = [result, "all-gather", k, k]
        elif whole and len(i.operands) == 1 and \
                math.prod(_dims(result)) == math.prod(_dims(alive[whole[0]][0])):
            alive[i.name] = [result, i.opcode, k, k]      # a copy, e.g. a new layout
    return [Whole(_dims(r), opcode, a, b, hlo.type_bytes(r),
                  hlo._phase(body[b].opcode, body[b].op_name()))
            for r, opcode, a, b in alive.values()]


def _dims(result: str) -> tuple[int, ...]:
    """``'f32[800,128]'`` -> ``(800, 128)``."""
    inside = result[result.index("[") + 1:result.index("]")] if "[" in result else ""
    return tuple(int(d) for d in inside.split(",") if d)
