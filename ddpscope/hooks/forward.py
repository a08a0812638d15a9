"""The attached DDP model's forward, timed from inside its own ``forward`` attribute.

And wherever torch.compile moves it (:class:`ForwardTiming`).

A module hook (``register_forward_pre_hook`` / ``register_forward_hook``) costs
more than the hook: any hook sends ``nn.Module.__call__`` down its general
path, which checks and iterates a dozen hook tables on every call. Empty
pre/post hooks cost ~12 us of training-thread CPU per step on the 2-core
development VM; the same two calls made from a callable in the instance's
``forward`` attribute, which ``__call__``'s fast path calls in place of the
class's ``forward``, were not measurable (benchmarks/step_hook_floor.py).

The callable is a small object, not a closure, for three reasons:

- ``torch.save(ddp_model)`` pickles the instance dict: it pickles as the
  model's own bound ``forward``, so the copy calls DDP's forward directly
  and carries no probe (as module hooks pickled as no-ops before);
- its ``__call__`` can be told to torch.compile as code to leave alone
  (:func:`ddpscope.hooks.compiled.run_eagerly`); a traced frame that inlines
  it sees ``torch.compiler.is_compiling()`` first and calls straight through;
- removing it is deleting one dict entry, and only if it is still ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddpscope.hooks import compiled
from ddpscope.hooks.modulehook import _ModuleHook

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _bound_forward(model: Any) -> Any:
    """The model's class ``forward``, bound: what an unpickled copy calls."""
    return type(model).forward.__get__(model, type(model))


class ForwardProbe:
    """Sits in ``ddp_model.__dict__["forward"]``; calls the tracker around DDP's forward.

    ``model`` is what the loop calls, ``ddp`` the DDP that owns its reducer: the
    same object, except for a module under ``replicate()`` (hooks/target.py),
    where the probe sits in the user's module and the tracker reads DDP's sync
    flags from the DDP its forward hooks drive.
    """

    __slots__ = ("ddp", "inner", "model", "tracker", "watch")

    def __init__(self, model: Any, tracker: Any, watch: Any, ddp: Any = None) -> None:
        self.model = model
        self.ddp = model if ddp is None else ddp
        self.inner = _bound_forward(model)
        self.tracker = tracker
        #: The recipe checks' per-forward probe (batch size, buffer broadcasts).
        self.watch = watch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return self.inner(*args, **kwargs)
        tr = self.tracker
        if not tr.enabled:
            return self.inner(*args, **kwargs)
        ddp = self.ddp
        try:
            tr.forward_pre(ddp, args)
        except Exception as exc:
            tr.fail(exc)
        # Guarded inside: a failure there turns the recipe checks off, not ddpscope.
        self.watch.forward_pre(self.model, args, kwargs)
        out = self.inner(*args, **kwargs)
        if tr.enabled:
            try:
                tr.forward_post(ddp, args, out)
            except Exception as exc:
                tr.fail(exc)
        return out

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return (_bound_forward, (self.model,))


class ForwardTiming:
    """Where one attached model's forward is timed, as torch.compile moves it.

    - eager: the probe in the DDP model's ``forward`` attribute;
    - ``torch.compile(ddp_model)``: the probe leaves before torch looks at the
      model (:meth:`leave_for_compile`), and module hooks on the compiled
      wrapper time its call from the interpreter (:meth:`follow_compiled`);
    - ``ddp_model.compile()``: the compiled call is wrapped in a function that
      calls the tracker around it (:meth:`wrap_compiled_call`).
    """

    def __init__(self, model: Any, tracker: Any, watch: Any, ddp: Any = None) -> None:
        self.model = model
        self.ddp = model if ddp is None else ddp
        self.tracker = tracker
        self.watch = watch
        self.compiled = False
        self._probe: ForwardProbe | None = ForwardProbe(model, tracker, watch, self.ddp)
        # object.__setattr__: nn.Module's own __setattr__ looks for parameters first.
        object.__setattr__(model, "forward", self._probe)
        self._hooks: list[Any] = []

    def leave_for_compile(self) -> None:
        """Take the probe out: torch.compile picks its entry by the type of ``forward``.

        With the probe there it would compile another program than the user's
        (one graph break and one frame fewer: tests/e2e/test_frameworks_compiled.py).
        """
        probe, self._probe = self._probe, None
        if probe is not None and self.model.__dict__.get("forward") is probe:
            del self.model.__dict__["forward"]  # unless replaced since: then it stays inert

    def remove(self) -> None:
        self.leave_for_compile()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def follow_compiled(self, wrapper: Any) -> bool:
        """``torch.compile(ddp_model)`` made ``wrapper``: time the forward from its hooks.

        The wrapper's hooks run in the interpreter around the compiled call. Left
        on the DDP module the timing would be traced, and a reading of the clock
        breaks the graph. False if the timing had moved already.
        """
        if self.compiled:
            return False
        self.compiled = True
        self.remove()
        # One pre-hook for the tracker and the recipe probe: each hook the module
        # calls costs a dispatch from C++ into Python.
        self._hooks = [
            wrapper.register_forward_pre_hook(self._guarded(self._pre), with_kwargs=True),
            wrapper.register_forward_hook(self._guarded(self.tracker.forward_post)),
        ]
        return True

    def wrap_compiled_call(self, compiled_fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """``ddp_model.compile()``: the compiled call, with the tracker around it.

        None if the timing had moved already.
        """
        if self.compiled:
            return None
        self.compiled = True
        self.remove()
        model, tracker = self.model, self.tracker
        pre = self._guarded(self._pre)
        post = self._guarded(tracker.forward_post)

        def call(*args: Any, **kwargs: Any) -> Any:
            if tracker.enabled:
                pre(model, args, kwargs)
            out = compiled_fn(*args, **kwargs)
            if tracker.enabled:
                post(model, args, out)
            return out

        compiled.run_eagerly(call)
        return call

    def time_this_call(self, args: Any, kwargs: Any) -> None:
        """Time a forward already under way: the probe came in during its pre-hooks.

        ``nn.Module.__call__`` reads ``forward`` before it runs the pre-hooks, so
        a probe put there by one of them (a module under ``replicate()`` is
        attached at its first forward, once its DDP exists) starts with the next
        call. This one is timed by hooks that remove themselves after it.
        """
        if self.compiled or not self.tracker.enabled:
            return
        self._pre(self.model, args, kwargs)
        post = self._guarded(self.tracker.forward_post)
        hooks: list[Any] = []

        def once(module: Any, call_args: Any, out: Any) -> None:
            for h in hooks:
                h.remove()
            post(module, call_args, out)

        hooks.append(self.model.register_forward_hook(once))

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        try:
            self.tracker.forward_pre(self.ddp, args)
        except Exception as exc:
            self.tracker.fail(exc)
        # Guarded inside: a failure there turns the recipe checks off, not ddpscope.
        self.watch.forward_pre(module, args, kwargs)

    def _guarded(self, fn: Callable[..., Any]) -> _ModuleHook:
        return _ModuleHook(fn, self.tracker.fail)


#: Whether torch.compile leaves ddpscope's forward timing to the interpreter.
EAGER_UNDER_COMPILE = compiled.run_eagerly(_ModuleHook.__call__, ForwardProbe.__call__)

__all__ = ["EAGER_UNDER_COMPILE", "ForwardProbe", "ForwardTiming"]
