"""Leaf modules' gradients: held back until the leaf's backward is over, then handed over together.

[Note: leaf modules]
A mixture-of-experts block sends each rank's tokens to different experts, so the ranks run
different modules; chunk groups are shared by modules and their collectives must come in the same
order on every rank, so a module that runs on one rank alone would gather, or complete a group's
gradients, where another rank does not. DeepSpeed's leaf modules (``set_z3_leaf_modules``,
``zero_optimization.leaf_module``; see ``deepspeed/utils/z3_leaf_module.py``) mark the block
whose inside may differ. A leaf is hooked as one module (nothing inside it is): its pre-forward
makes every tensor of its subtree a moment's (gathered on every rank, whichever experts run), its
post-forward and pre-backward likewise, and its parameters get no gradient hook of their own.
Their gradients are handed to the gradient sink (:meth:`GradientSink.take_grad`) together, in one
order every rank shares, when the leaf's backward is over (FSDP2's post-backward mark on its
inputs, see ``integration/hooks.py``), once every forward call of the leaf had its backward:
autograd runs a node created later first and a parameter's gradient accumulation as soon as it is
ready, so by the time the mark on the leaf's inputs runs, every gradient inside it exists. A
tensor a rank did not use gets a zero gradient (its slot zeroed, nothing added to an
accumulator), as ZeRO-3 gives unused experts ``torch.zeros_like``. Where the mark does not fire
(no input of the leaf requires grad, in any of its calls of the forward: a call on the model's input and
another later would otherwise hand over at the later call's mark, before the earlier call's backward; a
forward whose backward never came; a reentrant checkpoint whose recomputation runs inside backward) the
backward epilogue hands over what is left, leaf by
leaf in the same order, before it completes the other groups. The rest of the chunk machinery
sees a leaf as any module: the trace's moments, the keep policy and the gather order are the same
on every rank. Ranks that differ outside any leaf are stopped before their collectives do (see
[Note: ranks in lockstep]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..chunks.chunk import TensorInfo
from .grads import GradientSink


@dataclass
class Leaf:
    """One leaf module's tensors (its whole subtree's, each once, in module order) and this backward's calls."""

    name: str
    infos: list[TensorInfo]
    open_calls: int = 0  # forward calls marked for a post-backward that has not come yet
    handed: bool = field(default=False)  # its gradients went to the sink in this backward
    unmarked: bool = False  # a call of this forward had no input requiring grad: the epilogue hands over


class LeafGradients:
    """The leaf modules of a model and their held-back gradients; see [Note: leaf modules]."""

    def __init__(self, sink: GradientSink) -> None:
        self._sink = sink
        self._leaves: list[Leaf] = []

    def add(self, name: str, infos: list[TensorInfo]) -> int:
        """A leaf module with the tensors of its subtree; returns its index."""
        self._leaves.append(Leaf(name, infos))
        return len(self._leaves) - 1

    def __len__(self) -> int:
        return len(self._leaves)

    def called(self, index: int, marked: bool) -> None:
        """A training forward call of the leaf; ``marked``: its inputs got a post-backward mark. A call without
        one has a backward no mark ends, which may come after the marked calls' (a leaf called on the model's
        input and again later): its leaf's gradients wait for the epilogue."""
        leaf = self._leaves[index]
        if marked:
            leaf.open_calls += 1
        else:
            leaf.unmarked = True

    def backward_over(self, index: int, boundary: bool) -> None:
        """The backward of one forward call of the leaf is over; after the last, its gradients go."""
        leaf = self._leaves[index]
        leaf.open_calls -= 1
        if leaf.open_calls <= 0 and not leaf.handed and not leaf.unmarked:
            self._hand_over(leaf, boundary)

    def end_backward(self, boundary: bool) -> None:
        """The backward epilogue: every leaf not handed over yet is, in order; the next backward starts afresh."""
        for leaf in self._leaves:
            if not leaf.handed:
                self._hand_over(leaf, boundary)
        for leaf in self._leaves:
            leaf.open_calls, leaf.handed = 0, False

    def abort(self) -> None:
        """A backward raised (see [Note: a backward that raised]): the gradients held back go unused."""
        for leaf in self._leaves:
            leaf.open_calls, leaf.handed, leaf.unmarked = 0, False, False
            for info in leaf.infos:
                info.param.grad = None

    def _hand_over(self, leaf: Leaf, boundary: bool) -> None:
        leaf.handed = True
        for info in leaf.infos:
            if not info.trainable:  # a frozen tensor has no gradient (see [Note: frozen chunks])
                continue
            grad, info.param.grad = info.param.grad, None
            self._sink.take_grad(info, grad, boundary)  # None: a zero gradient
