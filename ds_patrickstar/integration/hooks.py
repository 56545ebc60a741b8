"""All hooks ds_patrickstar puts on a model, registered in one place with their handles kept.

[Note: which hook drives which state]
* module forward pre-hook: the module's own trainable params -> ``COMPUTE``
  (the chunk is materialized first);
* module forward post-hook: those params -> ``HOLD_AFTER_FWD`` once no enclosing module still
  uses them (see [Note: nested forward uses]); and a multi-grad hook on
  the module's outputs (tensors found inside tuples, lists, dicts and dataclasses) that
  fires when backward reaches the module: its params -> ``COMPUTE`` again;
* module post-backward (only on modules holding a parameter another module holds too, a
  tied weight, or a frozen parameter): an identity autograd function on the module's inputs
  whose backward runs once the module's backward is over; its tensors that still wait for a
  gradient stop being used (see [Note: tied weights between backward uses]), and so do its
  frozen tensors, which wait for none (see [Note: frozen chunks]; a recomputation inside backward
  marks the frozen ones only);
* per-parameter post-accumulate-grad hook (trainable parameters only): autograd has summed every use of the
  parameter in this backward (tied weights, modules called several times, direct use by
  a parent), so this is its last backward use: the gradient goes into the chunk
  (see [Note: gradient in the param slot]);
* a leaf module (DeepSpeed's ``set_z3_leaf_modules``) is hooked as one module holding every
  parameter of its subtree, nothing inside it is hooked, and its parameters get no
  post-accumulate-grad hook: a post-backward mark on its inputs hands their gradients over
  together (see [Note: leaf modules]).
With the emulated accelerator's meter or ``offload_activations``, a forward pre-hook on each block
(the model's repeated layers) sees its inputs and marks where its saved tensors begin (see
[Note: activation offload] and [Note: held inputs]).
The root module's forward pre-hook (registered first) and post-hook (registered last, after the
root module's own post-forward) move the run into and out of its forward (see [Note: run state]):
where an iteration's moments begin, for the memory tracer (see [Note: moments and the trace]).
Backward hooks move it into its backward, a forward hook inside backward into a recomputation.
A parameter never reached by backward gets its gradient (zero, or the accumulated sum)
in the backward epilogue. ``state_dict()`` of the top module returns host copies streamed
one chunk group at a time; ``load_state_dict()`` writes owned values into the chunks
itself and makes the fp32 masters follow (see [Note: state_dict]). Forward hooks also fire
during activation-checkpoint recomputation, which is just another ``COMPUTE`` use (a moment
labelled ``rec:``; see [Note: recomputation in the trace]).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ..autograd_state import iter_tensors
from ..chunks.chunk import TensorInfo
from .external_params import ExternalUses


class HookTarget(Protocol):
    def root_forward_start(self, inputs: Any) -> None: ...

    def root_forward_end(self) -> None: ...

    def pre_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None: ...

    def block_forward(self, index: int, inputs: Any) -> None: ...

    def post_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None: ...

    def pre_backward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None: ...

    def post_backward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None: ...

    def leaf_called(self, module: torch.nn.Module, marked: bool) -> None: ...

    def leaf_backward_over(self, module: torch.nn.Module) -> None: ...

    def grad_ready(self, info: TensorInfo, grad: torch.Tensor) -> None: ...

    def backward_begins(self, where: str = ...) -> None: ...

    def in_backward(self) -> bool: ...

    def before_load_state_dict(self, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]) -> None: ...

    def after_load_state_dict(self, incompatible_keys: Any) -> None: ...

    def after_state_dict(self, state_dict: dict[str, Any], prefix: str) -> None: ...


def _mark_post_backward(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict] | None:
    """``args`` and ``kwargs`` with their tensors that require grad passed through :class:`_PostBackward`
    (None, leaving the arguments as they are, when there is none: no post-backward then)."""
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not where and not keys:
        return None
    marked = _PostBackward.apply(callback, *(args[i] for i in where), *(kwargs[k] for k in keys))
    replaced, named = list(args), dict(kwargs)
    for i, tensor in zip(where, marked):
        replaced[i] = tensor
    for k, tensor in zip(keys, marked[len(where) :]):
        named[k] = tensor
    return tuple(replaced), named


class _PostBackward(torch.autograd.Function):
    """Identity on a module's input tensors; its backward runs once every gradient into them is
    computed, i.e. once the module's backward is over (FSDP2 marks the end of a module's
    backward the same way)."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.callback()
        return (None, *grads)


class HookRegistry:
    """Registers and removes every hook; see [Note: which hook drives which state]."""

    def __init__(
        self,
        module: torch.nn.Module,
        info_of: Callable[[torch.Tensor], TensorInfo | None],
        target: HookTarget,
        blocks: Sequence[torch.nn.Module] = (),
        leaves: Mapping[torch.nn.Module, list[TensorInfo]] | None = None,
    ) -> None:
        self._target = target
        self._external = ExternalUses(info_of, target)  # see [Note: external parameters]
        self._handles: list[RemovableHandle] = []
        self._what = (module, info_of, blocks, leaves or {})
        self.register_again()

    def register_again(self) -> None:
        """Every hook off (a handle removed already stays removed), then on again as at initialize: after a client
        removed handles (see [Note: hooks for generation] in generation_hooks.py)."""
        self.remove()
        try:
            self._register_all(*self._what)
        except BaseException:
            self.remove()  # a registration that fails part way leaves no hook behind
            raise

    @property
    def handles(self) -> list[RemovableHandle]:
        """The live list of the handles (each ``remove()``-able, as torch's)."""
        return self._handles

    def _register_all(
        self,
        module: torch.nn.Module,
        info_of: Callable[[torch.Tensor], TensorInfo | None],
        blocks: Sequence[torch.nn.Module],
        leaves: Mapping[torch.nn.Module, list[TensorInfo]],
    ) -> None:
        target = self._target
        self._handles.append(
            module.register_forward_pre_hook(
                lambda mod, args, kwargs: self._root_forward_start((args, kwargs)), with_kwargs=True
            )
        )
        for index, block in enumerate(blocks):  # registered before the blocks' own: see [Note: activation offload]
            self._handles.append(
                block.register_forward_pre_hook(
                    lambda mod, args, kwargs, i=index: target.block_forward(i, (args, kwargs)), with_kwargs=True
                )
            )
        holders = Counter(id(p) for sub in module.modules() for p in sub.parameters(recurse=False))
        inside = {id(m) for leaf in leaves for m in leaf.modules() if m is not leaf}
        for sub in module.modules():
            if id(sub) in inside:
                continue
            self._register_external(sub)  # before the module's own: see [Note: external parameters]
            if sub in leaves:
                self._register_module(sub, leaves[sub], [], leaf=True)
                continue
            infos = [i for p in sub.parameters(recurse=False) if (i := info_of(p)) is not None]
            if infos:
                tied = any(holders[id(i.param)] > 1 for i in infos)
                self._register_module(sub, infos, infos if tied else [i for i in infos if not i.trainable])
        # after the root module's own post-forward: the training forward is over once its uses are
        self._handles.append(module.register_forward_hook(lambda mod, args, output: self._root_forward_end(output)))
        self._handles.append(
            module.register_state_dict_post_hook(
                lambda mod, state_dict, prefix, meta: target.after_state_dict(state_dict, prefix)
            )
        )
        self._handles.append(
            module.register_load_state_dict_pre_hook(
                lambda mod, state_dict, prefix, metadata, strict, missing, unexpected, error_msgs: (
                    target.before_load_state_dict(state_dict, prefix, error_msgs)
                )
            )
        )
        self._handles.append(
            module.register_load_state_dict_post_hook(
                lambda mod, incompatible_keys: target.after_load_state_dict(incompatible_keys)
            )
        )
        seen = {id(i.param) for infos in leaves.values() for i in infos}  # handed over by their leaf
        for param in module.parameters():
            info = info_of(param)
            if info is not None and info.trainable and id(param) not in seen:
                seen.add(id(param))
                self._handles.append(param.register_post_accumulate_grad_hook(self._grad_hook(info)))

    def _register_module(
        self, sub: torch.nn.Module, infos: list[TensorInfo], post: list[TensorInfo], leaf: bool = False
    ) -> None:
        """``post``: the tensors whose backward use a post-backward ends (none: no post-backward); ``leaf``:
        a leaf module (see [Note: leaf modules])."""
        target = self._target

        def pre_forward(mod: torch.nn.Module, args: Any, kwargs: dict) -> Any:
            target.pre_forward(mod, infos)
            if not torch.is_grad_enabled():
                return None
            if not leaf:
                # a recomputation (inside backward) marks its frozen tensors only: see [Note: frozen chunks]
                ends = [i for i in post if not i.trainable] if target.in_backward() else post
                if not ends:
                    return None
                return _mark_post_backward(args, kwargs, lambda: target.post_backward(mod, ends))
            if target.in_backward():
                return None
            marked = _mark_post_backward(args, kwargs, lambda: target.leaf_backward_over(mod))
            target.leaf_called(mod, marked is not None)  # unmarked: the backward epilogue hands them over
            return marked

        def post_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
            target.post_forward(mod, infos)
            if torch.is_grad_enabled():
                outputs = [t for t in iter_tensors(output) if t.requires_grad]
                if outputs:
                    torch.autograd.graph.register_multi_grad_hook(
                        outputs, lambda grads: target.pre_backward(mod, infos), mode="any"
                    )

        self._handles.append(sub.register_forward_pre_hook(pre_forward, with_kwargs=True))
        self._handles.append(sub.register_forward_hook(post_forward))

    def _root_forward_start(self, inputs: Any) -> None:
        if not self._target.in_backward():
            self._external.clear()
        self._target.root_forward_start(inputs)

    def _register_external(self, sub: torch.nn.Module) -> None:
        external = self._external
        external.track(sub)

        def pre_forward(mod: torch.nn.Module, args: Any) -> None:
            if not self._target.in_backward():  # a recomputation's uses end with the backward they serve
                external.enter(mod)

        def post_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
            if not self._target.in_backward():
                external.leave(mod, output)

        self._handles.append(sub.register_forward_pre_hook(pre_forward))
        self._handles.append(sub.register_forward_hook(post_forward))

    def _root_forward_end(self, output: Any) -> None:
        """The root module's forward is over; when backward reaches its outputs, before any module, the
        backward's end is queued (see [Note: end of backward])."""
        target = self._target
        target.root_forward_end()
        outputs = [t for t in iter_tensors(output) if t.requires_grad]
        if outputs and not target.in_backward():
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda grads: target.backward_begins(), mode="any")

    def _grad_hook(self, info: TensorInfo) -> Callable[[torch.Tensor], None]:
        target = self._target

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            if grad is not None:
                target.grad_ready(info, grad)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)
