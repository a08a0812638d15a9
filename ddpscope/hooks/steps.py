"""Cutting training into steps and phases, from hooks DDP and autograd offer.

A step is one synchronising backward (all-reduce) and the optimizer work
after it. Its phases:

- data: from the end of the previous phase to the start of a forward;
- forward: the DDP module's forward pre-hook to its post-hook;
- backward: the ``backward()`` call to the end of autograd's work (a final
  callback queued from the model's marker parameter runs before DDP's own
  finalisation: :mod:`ddpscope.hooks.backward`);
- all-reduce wait: from there until DDP's finalisation has waited for every
  bucket (the ``backward()`` call returns);
- optimizer: the global optimizer step pre/post hooks, for optimizers that
  hold this model's parameters;
- other: the rest (loss, clipping, logging, evaluation without grad).

Collectives other than the gradient all-reduce (DDP's buffer broadcast at
the start of forward, a loss all-reduce, a barrier: see
:mod:`ddpscope.hooks.collectives`) are booked apart, as DDP-sync or user
collective waits, and taken out of whichever phase they interrupted, so the
phases and the waits add up to the step.

Phases nest in frameworks: Lightning runs forward and backward inside
``optimizer.step(closure)``; under manual optimization backward and the
optimizer step run inside the DDP forward (``training_step`` is what DDP
wraps). Each phase is booked exclusive of the phases nested in it: a phase
that opens inside another suspends it (its time so far is one interval) and
the outer one resumes when the inner ends, so no time is counted twice and the
phases still add up to the step. An optimizer step that ran a closure resumes
only once that closure's backward is done: the loss and hooks between the
forward and the backward are not optimizer work.

Counting survives the usual tricks: ``no_sync()`` micro-batches run backward
without an all-reduce and stay in the step; a step GradScaler skips (no
optimizer call) is closed at the next forward with ``optimizer_steps == 0``;
all-reduces a rank shadows under ``Join`` after running out of data are
counted apart and never open a step.

The hot path only stamps the clock and appends small tuples; turning tokens
into figures happens in :meth:`StepTracker.finish`, on the publisher thread.
The hooks are as few as a step allows (a forward probe in the model's
``forward`` attribute, one parameter hook and one final callback per
backward, the global optimizer step hooks) and the common case of each is
spelled out first, without calls: each entry from torch into Python and
each call inside it is a microsecond on a loaded host (docs/benchmarks.md).

Long module: one class, StepTracker, whose hooks (forward, backward, bucket,
collective, optimizer) read and write the same per-step state on the training
thread; split across objects, every hook would pay another attribute hop on the
hot path that benchmarks/hook_cost.py measures.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ddpscope.hooks import backward as backward_calls
from ddpscope.hooks import comm, loaderwait
from ddpscope.hooks.clocks import Clock
from ddpscope.hooks.evalmode import eval_mode_layers
from ddpscope.hooks.publisher import Publisher
from ddpscope.hooks.records import Collective, Interval, StepRecord
from ddpscope.hooks.unusedsearch import UnusedSearch
from ddpscope.schema import MAX_STEP_COLLECTIVES, REPLAY_MIN_STEPS, BucketLayout, Step

log = logging.getLogger("ddpscope")
#: A step's search figures for a model DDP does not search every step.
_NO_SEARCH: tuple[int, int, int, None] = (-1, -1, 0, None)

DATA, FORWARD, BACKWARD, WAIT, OPTIMIZER = range(5)
_PHASE_FIELD = {
    FORWARD: "forward_ns",
    BACKWARD: "backward_ns",
    WAIT: "comm_wait_ns",
    OPTIMIZER: "optimizer_ns",
}

#: Collectives kept per step beyond the listed ones: their time still counts in
#: the sums; past this a step (a joined rank's endless shadow step) stops growing.
_MAX_TIMED_COLLECTIVES = 1024

#: Steps during which every bucket's parameters are mapped; DDP rebuilds its
#: buckets during the second iteration, so a few steps cover the rebuild.
_MAP_STEPS = 3

#: Share of step time the per-bucket detail may take on average: the
#: interval between detailed steps grows until it fits.
BUCKET_BUDGET = 0.0025
#: Most steps between two with bucket detail (a power of two, so ranks that
#: pick different intervals still share the steps of the largest one, and the
#: watcher's bucket view always has a detailed step among the newest 64).
MAX_BUCKET_EVERY = 32

#: Detailed steps whose hook cost the interval is chosen from (their median).
_COST_SAMPLES = 5
#: Steps whose median is the step time the sampling intervals read.
_RECENT_STEPS = 32

_new_record = tuple.__new__
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_grad_enabled = torch.is_grad_enabled
_monotonic_ns = time.monotonic_ns
#: ddpscope's key in an output's hook table: RemovableHandle ids count up from 0.
_HOOK_KEY = -1


class SamplerState(Protocol):
    """The sampler probe's answer to "which epoch and pass": hooks/samplers.py."""

    last_epoch: int
    last_pass: int


def _hook_gradient(output: torch.Tensor, hook: Callable[[Any], None]) -> None:
    """Call ``hook`` when the gradient of ``output`` arrives in backward.

    The usual case, once per forward: the output's own hook table, handed to
    its autograd node as a tensor pre-hook. That is what
    ``Tensor.register_hook`` builds, without the ``RemovableHandle`` made and
    dropped each step: 3.0 us against 7.3 us for ``grad_fn.register_prehook``
    in a training loop (medians of 1,350 forwards each), and both at a
    fraction of the multi-grad hook's cost. The table is this output's alone,
    so a hook the user adds to the same tensor later joins it for that
    tensor only, and removing theirs leaves ours.
    """
    node = output.grad_fn
    if node is None:  # a leaf: nothing computed it
        output.register_hook(hook)
    elif output._backward_hooks is None:
        output._backward_hooks = OrderedDict(((_HOOK_KEY, hook),))
        node._register_hook_dict(output)
    else:  # hooked already inside the forward: leave that table alone
        node.register_prehook(hook)


def _grad_outputs(output: Any) -> list[torch.Tensor]:
    """Tensors in a forward's output that gradients will flow back through."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (list, tuple)):
        items = list(output)
    else:
        items = [getattr(output, k) for k in getattr(output, "__dataclass_fields__", ())]
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class StepTracker:
    def __init__(
        self,
        model: Any,
        model_index: int,
        clock: Clock,
        publisher: Publisher,
        param_index: dict[int, int],
        on_step_end: Callable[[int], None],
        sampler: SamplerState,
    ) -> None:
        self.model = model
        self.model_index = model_index
        self.clock = clock
        self.stamp = clock.stamp
        self.pub = publisher
        self.state = publisher.state
        self.param_index = param_index
        self.on_step_end = on_step_end
        #: on_step_end is called after steps from this one on; its owner moves it
        #: ahead when nothing is due before (0: every step).
        self.notify_at = 0
        #: Told of an error in a hook (the handle records it, then calls fail()).
        self.on_error: Callable[[BaseException], None] = self.fail
        #: Read at each step's close: the epoch and pass its batches came from.
        self.sampler = sampler
        self._finisher = self.finish
        self._lane, self._cap = publisher.lane
        self.enabled = True
        self.step = 0
        #: Added to every step number this tracker publishes (never to its own count,
        #: which its first-steps logic reads): the steps of the model it took over
        #: from when the same parameters were wrapped in a new DDP (hooks/attach.py).
        self.step_base = 0
        #: Steps between two that carry per-bucket detail; adapted in _close.
        self.bucket_every = 1
        #: ddpscope's comm hook is registered on this model (hooks/comm.py):
        #: buckets can be timed. Off until hooks/bucket_cost.py says it fits.
        self.hooked = False
        self._hooked_at = 0
        #: Called (once) when the step cutting needs the comm hook: outputs
        #: with no tensor to mark backward's start from.
        self.request_hook: Callable[[], None] | None = None
        #: DDP's per-step search for unused parameters, where it runs one
        #: (hooks/unusedsearch.py): its cost and what it found, taken at each close.
        self.search: UnusedSearch | None = None
        self._reducer_params: list[Any] | None = None
        #: Set (benchmarks, tests) to hold the interval instead of adapting it.
        self.fixed_every: int | None = None
        #: The current step is timed per bucket.
        self.detail = True
        #: Buckets of this backward take the comm hook's untimed path: set while
        #: a backward of a step without detail runs (read by comm.timed_hook).
        self.cheap = False
        #: Wall ns spent in the comm hook on the current detailed step (written
        #: by comm.timed_hook), and the last few detailed steps' values.
        self.detail_ns = 0
        self._detail_costs: deque[int] = deque(maxlen=_COST_SAMPLES)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.trainable = {id(p) for p in trainable}
        #: With ``gradient_as_bucket_view``, one parameter whose gradient each training
        #: forward looks at: ``grads_viewed`` says whether gradients were kept as views
        #: of DDP's buckets, which decides how DDP's C++ path would scale them
        #: (hooks/comm.py averages as it would).
        as_view = getattr(model, "gradient_as_bucket_view", False) is True
        self._view_probe = trainable[0] if as_view and trainable else None
        self.grads_viewed = False
        self._opt_relevant: dict[int, tuple[bool, bool, weakref.ref[Any]]] = {}
        self.optimizers: dict[int, Any] = {}
        # layout of the buckets: generation, {index: nbytes}, param lists
        self.layout_gen = 0
        self._layout: dict[int, int] = {}
        self._layout_params: dict[int, list[int]] = {}
        self._layout_dtype: dict[int, str] = {}
        self._layout_dirty = False
        self._layout_step = 0
        self._recent: deque[int] = deque(maxlen=_RECENT_STEPS)
        self._median = 0
        # Bound once: autograd gets these on every step, and a bound method
        # made per call is an allocation on the hot path.
        self._on_backward = self._backward_begin
        self._on_compute_end = self._after_compute
        self._on_finalized = self._after_finalize
        self._on_marker = self._marker_ready
        #: The clock's tokens are host monotonic ns: phase changes reuse the stamp.
        self._cpu = clock.name == "cpu"
        #: A training forward began since this model's last backward did: the next
        #: backward() call may be its own (hooks/backward.py stamps it).
        self.armed = False
        #: Inside a backward() call hooks/backward.py saw while armed; ``call_token``
        #: is the token stamped when it began.
        self.in_call = False
        self.call_token = 0
        #: (start, end) tokens of the last backward() call, made while armed, that
        #: never reached the marker: kept for :meth:`_marker_missed`.
        self._missed: tuple[int, int] | None = None
        #: End of autograd's work in the open backward (None until its callback ran).
        self._compute_end: int | None = None
        #: The post-accumulate-grad hook on the marker parameter (None: the
        #: forward output's gradient hook marks backward instead).
        self._marker: Any = None
        self._new_step(None)
        #: hooks/loaderwait.py's totals at the last step's close.
        self._fetch_mark = loaderwait.waited_ns
        self._calls_mark = loaderwait.calls
        #: Steps that drew since a pass last ran out; how many drew up to that pass's
        #: end; steps in a row since then that drew fewer than ``_base``, the draws of
        #: the last step with nothing run out (see _count_replay).
        self._drew = 0
        self._fed = 0
        self._replayed = 0
        self._base = 0
        #: The process-wide id of the pass that ran out (-1: a loader not followed).
        self._replay_pass = -1
        self._stops_mark = loaderwait.stops
        self._out_mark = len(loaderwait.ran_out)
        #: Off once a whole pass went without a draw and no itertools.cycle exists.
        self._replay_on = True
        #: The layers eval mode changes, found at the first step trained in eval mode
        #: (None: none such step yet).
        self._eval_layers: tuple[str, ...] | None = None
        self._prev_end: int | None = None
        self._eval_start = 0
        self._fwd_start = 0
        self._fwd_sync = True
        self._bwd_start: int | None = None
        self._bwd_sync = False
        self._compute_end = 0
        self._opt_start: int | None = None
        #: Relevant optimizer steps open, one inside another: ZeroRedundancyOptimizer
        #: and accelerate's wrapper step an inner optimizer, then finish their own.
        self._opt_depth = 0
        #: id() of the optimizer whose step opened the phase.
        self._opt_outer = 0
        #: Open forward/optimizer calls, innermost last: [phase, start of the
        #: running interval or None while a nested phase holds the time,
        #: resume only after a backward (an optimizer that ran a closure)].
        self._open: list[list[Any]] = []
        #: (end of the previous phase, optimizer start) when an optimizer step
        #: opened after a gap; a closure's forward books that gap as data.
        self._opt_gap: tuple[int, int] | None = None

    def _new_step(self, start: int | None) -> None:
        self._start = start
        every = self.bucket_every if self.fixed_every is None else self.fixed_every
        self._timed = self.hooked
        self.detail = self.hooked and (
            self.step < self._hooked_at + _MAP_STEPS or self.step % every == 0
        )
        self.cheap = False
        self.detail_ns = 0
        self._iv: list[Interval] = []
        self._b_index: list[int] = []
        self._b_nbytes: list[int] = []
        self._b_start: list[int] = []
        self._b_end: list[int] = []
        self._fwd = 0
        #: Training forwards (gradients on) of the step with the model in eval mode.
        self._eval_fwd = 0
        self._bwd = 0
        self._synced = False
        self._opt = 0
        self._eval_ns = 0
        self._c: list[Collective] = []
        self._c_lost = 0
        self._join = False

    def take_over(self, old: StepTracker) -> None:
        """Go on from ``old``, the tracker of a DDP model this one's replaced over the
        same parameters: one model to the watcher, so its steps and bucket layouts are
        numbered on from the old ones and the first step here starts where the old
        wrapper's last one ended, with what the loop did since (its collectives, its
        batches' waits) in it."""
        self.step_base = old.step + old.step_base
        self.layout_gen = old.layout_gen
        if old.step and not (old._fwd or old._bwd or old._opt or old._open):
            self._start, self._prev_end = old._start, old._prev_end
            self._iv, self._c, self._c_lost = old._iv, old._c, old._c_lost
            self._fetch_mark, self._calls_mark = old._fetch_mark, old._calls_mark

    # --- forward -------------------------------------------------------------

    def forward_pre(self, module: Any, args: Any) -> None:
        if not self.enabled:
            return
        if not _grad_enabled():
            # Host clock: evaluation can run thousands of batches between two
            # steps, which must not cycle the CUDA event ring.
            self._eval_start = _monotonic_ns()
            self.state.enter("eval")
            return
        t = self.stamp()
        if self._view_probe is not None:
            grad = self._view_probe.grad
            self.grads_viewed = grad is not None and grad._is_view()
        open_ = self._open
        if open_:
            self._forward_inside(t)
        else:  # the usual case: a forward at the top of the loop
            if self._synced:
                # A synced backward without an optimizer step after it: GradScaler
                # skipped the step, or the update is done by hand.
                self._close(self._prev_end if self._prev_end is not None else t)
            if self._start is None:
                self._start = t
            elif self._prev_end is not None:
                self._iv.append((DATA, self._prev_end, t))
        open_.append([FORWARD, t, False])
        self._fwd_start = t
        self._fwd_sync = getattr(module, "require_backward_grad_sync", True)
        join_config = getattr(module, "_join_config", None)
        if join_config is not None and join_config.enable:
            self._join = True
            if getattr(module, "_divide_by_initial_world_size", True) is False:
                comm.count_active_ranks()
        self._fwd += 1
        if not module.training and not getattr(module, "module", module).training:
            self._eval_fwd += 1  # model.eval() not undone: dropout off, BatchNorm frozen
        # From here a backward() call may be this model's: Lightning's manual
        # optimization calls it inside the forward.
        self.armed = True
        st = self.state
        st.phase = "forward"
        st.since_ns = t if self._cpu else _monotonic_ns()

    def _forward_inside(self, t: int) -> None:
        """A forward that opens while a forward or an optimizer step is open."""
        if any(e[0] == FORWARD for e in self._open):
            # The last forward never returned (an exception the script caught, as
            # skip-the-batch-on-OOM loops do): forget it, or it would hold every
            # later forward as nested in it.
            while self._open and self._open.pop()[0] != FORWARD:
                pass
            self._prev_end = t  # the failed forward's time is "other", not data
        if self._synced and not self._open:
            self._close(self._prev_end if self._prev_end is not None else t)
        if self._start is None:
            self._start = t
        elif not self._open and self._prev_end is not None:
            self._iv.append((DATA, self._prev_end, t))
        elif self._opt_gap is not None and [e[0] for e in self._open] == [OPTIMIZER]:
            # A closure's forward: the wait before optimizer.step() was for data.
            self._iv.append((DATA, *self._opt_gap))
            self._opt_gap = None
        if self._open and self._open[-1][0] == OPTIMIZER:
            self._open[-1][2] = True
        self._suspend(t)

    def forward_post(self, module: Any, args: Any, output: Any) -> None:
        if not self.enabled:
            return
        if not _grad_enabled():
            self._eval_ns += _monotonic_ns() - self._eval_start
            self.state.enter("idle")
            return
        t = self.stamp()
        open_ = self._open
        top = open_.pop() if open_ else None
        if top is not None and top[0] == FORWARD:
            if top[1] is not None:
                self._iv.append((FORWARD, top[1], t))
            if open_:
                self._resume(t, after_backward=False)
        elif top is not None:
            open_.append(top)  # not ours to close (should not happen)
        self._prev_end = t
        st = self.state
        st.phase = "idle"
        st.since_ns = t if self._cpu else _monotonic_ns()
        if self._marker is not None:
            return  # the marker parameter marks backward: nothing to hang on the output
        if type(output) is torch.Tensor:
            if output.requires_grad:
                _hook_gradient(output, self._on_backward)
            return
        outs = _grad_outputs(output)
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, self._on_backward, mode="any")
        elif not self.hooked and self.request_hook is not None:
            # Nothing to hang backward's start on: the first bucket marks it.
            request, self.request_hook = self.request_hook, None
            request()

    # --- backward (autograd threads) -----------------------------------------

    def use_marker(self) -> bool:
        """Mark backward from one parameter's post-accumulate-grad hook.

        The model's last trainable parameter: in DDP's first bucket, ready first
        in backward. Where parameters may go without a gradient in some steps
        (``find_unused_parameters``) the forward output's gradient hook marks
        backward instead, as it fires whenever the model's output takes part.
        A marker that gets no gradient though (a static graph that never uses
        it, a head frozen after attach) is found at the optimizer step and
        handed over then (:meth:`_marker_missed`). True if the marker is set.
        """
        model = self.model
        if getattr(model, "find_unused_parameters", False):
            return False
        params = [p for p in model.parameters() if p.requires_grad]
        if not params or not hasattr(params[-1], "register_post_accumulate_grad_hook"):
            return False
        self._marker = params[-1].register_post_accumulate_grad_hook(self._on_marker)
        return True

    def drop_marker(self) -> None:
        if self._marker is not None:
            self._marker.remove()
            self._marker = None

    def _marker_ready(self, _param: Any) -> None:
        if not self.enabled or self._bwd_start is not None:
            return
        t = self.call_token if self.in_call else self.stamp()
        if backward_calls.depth == 1 and not self._open:
            # The usual case, _backward_open() spelled out: a backward() at the top
            # of the loop reached this model.
            self._bwd_start = t
            self.armed = False
            self._missed = None
            self._compute_end = None
            self._bwd_sync = self._fwd_sync
            self.cheap = not self.detail
            st = self.state
            st.phase = "backward"
            st.since_ns = t if self._cpu else _monotonic_ns()
            _queue_callback(self._on_compute_end)
            return
        if backward_calls.depth > 1:
            # Reached inside a nested backward (reentrant checkpointing around the
            # marker's layer): a callback queued here would run when that inner
            # backward ends. The call's return ends this one; the output's hook
            # marks the next ones.
            self.drop_marker()
            self._backward_open(t, queue=False)
            return
        self._backward_open(t, queue=True)

    def _backward_begin(self, _grad: Any = None) -> None:
        # The forward output's gradient hook (no marker parameter).
        if not self.enabled or self._bwd_start is not None:
            return
        self._backward_open(self.call_token if self.in_call else self.stamp(), queue=True)

    def _backward_open(self, t: int, queue: bool) -> None:
        self._bwd_start = t
        self.armed = False
        self._missed = None
        self._compute_end = None
        if self._open:
            self._suspend(t)
        self._bwd_sync = self._fwd_sync
        self.cheap = not self.detail
        st = self.state
        st.phase = "backward"
        st.since_ns = t if self._cpu else _monotonic_ns()
        if queue:
            _queue_callback(self._on_compute_end)

    def _after_compute(self) -> None:
        # Runs when autograd's work is done, before DDP waits for the buckets.
        t = self._compute_end = self.stamp()
        st = self.state
        st.phase = "allreduce"
        st.since_ns = t if self._cpu else _monotonic_ns()
        if not self.in_call:
            # No backward() call seen to return: a callback queued from this one
            # runs after DDP's own finalisation.
            _queue_callback(self._on_finalized)

    def _after_finalize(self) -> None:
        self._backward_end(self.stamp())

    def backward_called(self) -> None:
        """hooks/backward.py: a backward() call begins while this model is armed."""
        self.call_token = self.stamp()
        self.in_call = True

    def backward_returned(self) -> None:
        """hooks/backward.py: that call returned (or raised)."""
        t = self.stamp()
        self.in_call = False
        start = self._bwd_start
        if start is None:
            if self.armed:
                self._missed = (self.call_token, t)
            return
        end = self._compute_end
        if end is None or self._open or not self._bwd_sync:
            self._backward_end(t)
            return
        # The usual case, _backward_end() spelled out: a synced backward at the top
        # of the loop.
        iv = self._iv
        iv.append((BACKWARD, start, end))
        iv.append((WAIT, end, t))
        self._bwd_start = None
        self.cheap = False
        self._prev_end = t
        self._bwd += 1
        self._synced = True
        st = self.state
        st.phase = "idle"
        st.since_ns = t if self._cpu else _monotonic_ns()

    def _backward_end(self, t: int) -> None:
        start = self._bwd_start if self._bwd_start is not None else t
        end = self._compute_end if self._compute_end is not None else t
        iv = self._iv
        iv.append((BACKWARD, start, end))
        iv.append((WAIT, end, t))
        self._bwd_start = None
        self.cheap = False
        self._prev_end = t
        self._bwd += 1
        if self._bwd_sync:
            self._synced = True
        if self._open:
            self._resume(t, after_backward=True)
        st = self.state
        st.phase = "idle"
        st.since_ns = t if self._cpu else _monotonic_ns()

    def _marker_missed(self, t: int) -> None:
        """The model's optimizer stepped with no backward marked since its forward.

        A backward() call ran after the forward but never reached the marker
        parameter: it got no gradient (a head frozen or skipped after attach).
        That call is booked as this step's backward, its all-reduce wait not
        told apart, so that every rank still counts the same steps; the
        output's gradient hook marks backward from the next forward on.
        """
        assert self._missed is not None
        start, end = self._missed
        self._missed = None
        self._iv.append((BACKWARD, start, end))
        self._bwd += 1
        self.drop_marker()
        log.info(
            "ddpscope: model %d's marker parameter got no gradient; its backward is "
            "marked from the forward output from now on",
            self.model_index,
        )
        self._close(t)

    # --- buckets (called by the comm hook wrapper) ---------------------------

    def bucket_start(self, bucket: Any) -> tuple[list[int], int] | None:
        if not self.enabled:
            return None
        try:
            if self._fwd == 0 and self._bwd_start is None and not self._open:
                # No forward in this step: a joined rank shadowing all-reduces
                # (counted once per pass by join_pass).
                self.state.enter("join")
                return None
            if self._bwd_start is None:  # a bucket before the marker (or no output hook)
                self._backward_open(self.call_token if self.in_call else self.stamp(), queue=True)
                if not self.detail:  # the rest of this backward takes the untimed path
                    self.state.bucket = bucket.index()
                    return None
            t = self.stamp()
            index = bucket.index()
            buf = bucket.buffer()
            nbytes = buf.numel() * buf.element_size()
            if self._layout.get(index) != nbytes or self.step < _MAP_STEPS:
                self._map_bucket(bucket, index, nbytes, str(buf.dtype).replace("torch.", ""))
            pos = len(self._b_end)
            self._b_index.append(index)
            self._b_nbytes.append(nbytes)
            self._b_start.append(t)
            self._b_end.append(-1)
            self.state.bucket = index
            return self._b_end, pos
        except Exception as exc:
            self.fail(exc)
            return None

    def hooked_now(self) -> None:
        """ddpscope's comm hook was registered: time buckets from the next step."""
        self.hooked = True
        if self._start is None and not self._open:  # before the first forward
            self._hooked_at = self.step
            self.detail = self._timed = True
        else:
            self._hooked_at = self.step + 1

    def join_pass(self) -> None:
        """A joined rank shadows one backward's all-reduces (DDP's Join hook)."""
        if self.enabled:
            self.state.join_shadow += 1
            self.state.enter("join")

    def _layout_from_reducer(self) -> None:
        """The bucket layout from DDP's own logging data, without the comm hook.

        After the rebuild in the second iteration DDP reports each bucket's
        bytes and its parameters' indices into the reducer's parameter list
        (the trainable, deduplicated parameters in module order). Before it,
        or where DDP never rebuilds (``find_unused_parameters``), the sizes
        are the initial assignment's and the parameters unknown.
        """
        data = self.model._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        groups = data.get("rebuilt_per_bucket_param_indices") or ""
        nbytes = [int(x) for x in str(sizes).split(",") if x.strip()]
        if not nbytes:
            return
        per = [[int(i) for i in g.split()] for g in str(groups).split(",")] if groups else []
        if self._reducer_params is None:
            self._reducer_params = list(self.model._build_params_for_reducer()[0])
        params = self._reducer_params
        for index, size in enumerate(nbytes):
            members = per[index] if len(per) == len(nbytes) else []
            mapped = [
                self.param_index.get(id(params[i]), -1) if i < len(params) else -1 for i in members
            ]
            first = members[0] if members and members[0] < len(params) else 0
            owner = params[first] if params else None
            dtype = str(owner.dtype).replace("torch.", "") if owner is not None else "float32"
            self._set_bucket(index, size, mapped, dtype)
        self._forget_buckets(range(len(nbytes)))

    def _map_bucket(self, bucket: Any, index: int, nbytes: int, dtype: str) -> None:
        params = [self.param_index.get(id(p), -1) for p in bucket.parameters()]
        self._set_bucket(index, nbytes, params, dtype)

    def _set_bucket(self, index: int, nbytes: int, params: list[int], dtype: str) -> None:
        if self._layout.get(index) != nbytes or self._layout_params.get(index) != params:
            self._layout[index] = nbytes
            self._layout_params[index] = params
            self._layout_dtype[index] = dtype
            self._layout_dirty = True

    def _forget_buckets(self, kept: Any) -> None:
        """A rebuild left fewer buckets: forget the indices not in ``kept``."""
        for gone in [i for i in self._layout if i not in kept]:
            del self._layout[gone], self._layout_params[gone], self._layout_dtype[gone]
            self._layout_dirty = True

    # --- other collectives (called by hooks/collectives.py) ------------------

    def phase_begin(self, phase: str) -> str | None:
        """The training thread entered work the heartbeat names (``torch.save``)."""
        if not self.enabled:
            return None
        st = self.state
        prev = st.phase
        st.enter(phase)
        return prev

    def phase_end(self, prev: str) -> None:
        self.state.enter(prev)

    def collective_begin(self, op: str, cls: str, site: str) -> tuple[int, str] | None:
        if not self.enabled:
            return None
        st = self.state
        prev = st.phase
        st.coll_op, st.coll_class, st.coll_site = op, cls, site
        st.enter("collective")
        return self.stamp(), prev

    def collective_end(
        self, begun: tuple[int, str], op: str, cls: str, group: str, nbytes: int, site: str
    ) -> None:
        t = self.stamp()
        start, prev = begun
        self.state.enter(prev)
        if not self.enabled or self._start is None:
            return  # before the first forward: no step to book it in
        if len(self._c) < _MAX_TIMED_COLLECTIVES:
            self._c.append((cls == "ddp", op, group, nbytes, site, start, t, prev == "eval"))
        else:
            self._c_lost += 1

    # --- optimizer (global hooks, any thread that steps) ---------------------

    def _relevance(self, opt: Any) -> tuple[bool, bool, weakref.ref[Any]]:
        key = id(opt)
        known = self._opt_relevant.get(key)
        if known is None or known[2]() is not opt:
            # Also when the id is an optimizer's that is gone: a new one (another
            # model's, freed, then this model's) can be made at the same address.
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            known = (bool(ids & self.trainable), self.trainable <= ids, weakref.ref(opt))
            self._opt_relevant[key] = known
            if known[0]:
                self.optimizers[key] = opt
        return known

    # Registered as global optimizer step hooks (one pair per attached model):
    # every optimizer step of the process calls them, so each is one frame with
    # its own guard.

    def optimizer_pre(self, opt: Any, _args: Any = None, _kwargs: Any = None) -> None:
        if not self.enabled:
            return
        try:
            known = self._opt_relevant.get(id(opt))
            if known is None or known[2]() is not opt:
                known = self._relevance(opt)
            if not known[0]:
                return
            if self._opt_start is not None and id(opt) != self._opt_outer:
                self._opt_depth += 1  # an inner optimizer, stepped by the outer one
                return
            # The outer one opens the phase; the same one again means its last step
            # raised before its post-hook ran, and this step replaces it.
            self._opt_depth = 1
            self._opt_outer = id(opt)
            if self._opt_start is None:
                t = self._opt_start = self.stamp()
                if self._start is None:
                    self._start = t  # a closure-based step begins in optimizer.step()
                self._opt_gap = None
                open_ = self._open
                if open_:
                    self._suspend(t)
                elif self._prev_end is not None:
                    self._opt_gap = (self._prev_end, t)
                open_.append([OPTIMIZER, t, False])
                st = self.state
                st.phase = "optimizer"
                st.since_ns = t if self._cpu else _monotonic_ns()
        except Exception as exc:
            self.on_error(exc)

    def optimizer_post(self, opt: Any, _args: Any = None, _kwargs: Any = None) -> None:
        if not self.enabled or self._opt_start is None:
            return
        try:
            known = self._opt_relevant.get(id(opt))
            if known is None or known[2]() is not opt:
                known = self._relevance(opt)
            if not known[0]:
                return
            open_ = self._open
            if (
                known[1]
                and self._bwd > 0
                and self._opt_depth == 1
                and len(open_) == 1
                and open_[0][0] == OPTIMIZER
            ):
                # The usual case, _optimizer_done() spelled out: the optimizer step
                # that holds the whole model ends the step.
                t = self.stamp()
                start = open_[0][1]
                if start is not None:
                    self._iv.append((OPTIMIZER, start, t))
                open_.clear()
                self._opt_depth = 0
                self._opt_start = None
                self._opt_gap = None
                self._opt += 1
                self._close(t)
                return
            self._optimizer_done(known[1])
        except Exception as exc:
            self.on_error(exc)

    def _optimizer_done(self, covers_all: bool) -> None:
        if self._opt_depth > 1:
            # An inner optimizer's step is done; the one around it (which may still
            # broadcast its shards: ZeRO) ends the phase.
            self._opt_depth -= 1
            return
        self._opt_depth = 0
        t = self.stamp()
        open_ = self._open
        if len(open_) == 1 and open_[0][0] == OPTIMIZER:
            # The usual case: the optimizer step is all that is open.
            if open_[0][1] is not None:
                self._iv.append((OPTIMIZER, open_[0][1], t))
            open_.clear()
        else:
            for i in range(len(open_) - 1, -1, -1):
                entry = open_[i]
                if entry[0] == OPTIMIZER:
                    if entry[1] is not None:
                        self._iv.append((OPTIMIZER, entry[1], t))
                    del open_[i:]  # a forward left open inside it is over too
                    break
            if open_:
                self._resume(t, after_backward=False)
        self._opt_start = None
        self._opt_gap = None
        self._opt += 1
        self._prev_end = t
        st = self.state
        st.phase = "idle"
        st.since_ns = t if self._cpu else _monotonic_ns()
        if covers_all:  # this optimizer holds every trainable parameter: the step is done
            if self._bwd > 0:
                self._close(t)
            elif self._missed is not None and self._marker is not None:
                self._marker_missed(t)

    # --- nesting ---------------------------------------------------------------

    def _suspend(self, t: int) -> None:
        """A nested phase starts at ``t``: book the running one's time so far."""
        if self._open:
            top = self._open[-1]
            if top[1] is not None:
                self._iv.append((top[0], top[1], t))
                top[1] = None

    def _resume(self, t: int, after_backward: bool) -> None:
        """A nested phase ended at ``t``: the enclosing one runs again."""
        if self._open:
            top = self._open[-1]
            if top[1] is None and (after_backward or not top[2]):
                top[1] = t
                if top[0] == FORWARD:
                    self.state.enter("forward")
                elif top[0] == OPTIMIZER:
                    self.state.enter("optimizer")

    # --- closing a step ------------------------------------------------------

    def _close(self, end: int) -> None:
        start = self._start
        if start is None:
            start = self._start = end
        step = self.step
        b_index = self._b_index
        if step < _MAP_STEPS or b_index or self._layout_dirty:
            self._close_layout(step, b_index, end)
        every = self.bucket_every if self.fixed_every is None else self.fixed_every
        sampler = self.sampler
        # The pass the training thread last drew from, else the one whose sampler last
        # yielded (a loop drawing on a thread of its own).
        drawn = loaderwait.drawn
        waited, calls = loaderwait.waited_ns, loaderwait.calls
        fetches = calls - self._calls_mark
        if self._replay_on:
            if loaderwait.ran_out or self._replayed or loaderwait.stops != self._stops_mark:
                self._count_replay(fetches)
            elif fetches:  # the usual step (nothing out, no draw raised): its first branch
                self._drew += 1
                self._base = fetches
        eval_mode = False
        eval_layers = None
        if self._eval_fwd:  # rare: a forward in eval mode with gradients on
            eval_mode = self._eval_fwd >= self._fwd
            if eval_mode and self._eval_layers is None:
                # Once per tracker: which of the model's layers eval mode changes.
                eval_layers = self._eval_layers = eval_mode_layers(self.model)
        search = self.search
        search_ns, unused, unused_set, unused_names = (
            search.take(self._synced) if search is not None else _NO_SEARCH
        )
        # tuple.__new__: the record's fields without NamedTuple's Python __new__
        # (175 ns against 710 ns, timeit).
        record = _new_record(
            StepRecord,
            (
                step,
                start,
                end,
                self._iv,
                b_index,
                self._b_nbytes,
                self._b_start,
                self._b_end,
                self._bwd,
                self._opt,
                drawn.epoch if drawn is not None and drawn.distributed else sampler.last_epoch,
                sampler.last_pass if drawn is None else drawn.gid,
                self.layout_gen,
                self._eval_ns,
                self._c,
                self._c_lost,
                self._join,
                self.detail,
                every if self._timed else 0,
                self._opt > 0 and self._bwd > 0 and not self._synced,
                waited - self._fetch_mark,
                fetches,
                self._fwd == 0 and self._bwd > 0,
                loaderwait.batch_digest,
                drawn is not None,
                loaderwait.worker_copies,
                search_ns,
                unused,
                unused_set,
                unused_names,
                self._replayed,
                self._fed if self._replayed else 0,
                self._replay_pass,
                eval_mode,
                eval_layers,
                loaderwait.pass_repeat,
            ),
        )
        self._fetch_mark, self._calls_mark = waited, calls
        loaderwait.batch_digest = loaderwait.worker_copies = 0
        loaderwait.pass_repeat = None
        cpu = self._cpu
        pub, lane = self.pub, self._lane
        if pub.alive:  # Publisher.post, spelled out
            if len(lane) < self._cap:
                born = end if cpu else _monotonic_ns()
                lane.append((Step.KIND, self.model_index, record, self._finisher, born))
            else:
                pub.dropped_queue += 1
        if step < _RECENT_STEPS:
            # The median step time over the first steps, here: the comm-hook decision
            # (step 8) reads it. Later ones are noted by finish(), off this thread.
            host = self.clock.host_ns
            self._note_step_time(step, end - start if cpu else host(end) - host(start))
        if self.detail and b_index:
            self._adapt_bucket_every(self.detail_ns)
            every = self.bucket_every if self.fixed_every is None else self.fixed_every
        step += 1
        self.step = step
        st = self.state
        st.step = step + self.step_base
        st.bucket = -1
        # Where this step drew from a DataLoader, the next one's waits mark "data"
        # themselves (hooks/loaderwait.py); the rest of the gap is its own code.
        st.phase = "idle" if fetches else "data"
        st.since_ns = end if self._cpu else _monotonic_ns()
        # The next step, spelled out (this runs every step).
        self._start = end
        hooked = self.hooked
        self._timed = hooked
        self.detail = hooked and (step < self._hooked_at + _MAP_STEPS or step % every == 0)
        self.cheap = False
        self.detail_ns = 0
        self._iv = []
        self._b_index = []
        self._b_nbytes = []
        self._b_start = []
        self._b_end = []
        self._fwd = self._bwd = self._opt = self._eval_ns = self._c_lost = self._eval_fwd = 0
        self._synced = self._join = False
        self._c = []
        self._prev_end = end
        for entry in self._open:
            if entry[1] is not None:
                # Manual optimization: the rest of this forward is the next step's.
                entry[1] = end
                if entry[0] == FORWARD:
                    self._fwd = 1  # its backwards come through DDP's forward: not bypassed
        if step >= self.notify_at:
            self.on_step_end(step)

    def _count_replay(self, fetches: int) -> None:
        """Steps in a row that draw fewer batches than before a loader ran out, with that
        loader not drawn from since: training on batches kept from its pass."""
        stops = loaderwait.stops
        draws = fetches - (stops - self._stops_mark)
        self._stops_mark = stops
        out = len(loaderwait.ran_out)
        grew, self._out_mark = out > self._out_mark, out
        if not out:
            self._replayed = 0
            if draws:
                self._drew += 1
                self._base = draws
        elif grew:
            # A pass ran out in this step: the steps it fed. One pass's worth of draws
            # at once (a list(loader)) fed one step: left alone.
            self._fed, self._drew, self._replayed = self._drew + (draws > 0), 0, 0
            out_pass = loaderwait.last_out
            self._replay_pass = out_pass.gid if out_pass is not None else -1
        elif draws < self._base and self._fed > 1:
            self._replayed += 1
            if self._replayed == max(self._fed, REPLAY_MIN_STEPS):
                # A whole pass so: from a cycle, or from a source that is not a
                # DataLoader (asked once a run).
                self._replay_on = loaderwait.cycle_in_process()
                if not self._replay_on:
                    self._replayed = 0
        else:
            self._replayed = 0

    def _close_layout(self, step: int, b_index: list[int], end: int) -> None:
        """The bucket layout: read from DDP over the first steps, posted when it changed."""
        if not self.hooked and step < _MAP_STEPS:
            try:
                self._layout_from_reducer()
            except Exception as exc:  # private DDP API: a torch without it shows no layout
                if step == 0:
                    log.debug("ddpscope: no bucket layout from DDP: %r", exc)
        if b_index and len(b_index) != len(self._layout):
            self._forget_buckets(set(b_index))
        if self._layout_dirty:
            self._post_layout(end)

    def flush(self) -> None:
        """Close a step left open at exit (its optimizer never ran)."""
        if self._synced or self._bwd:
            self._close(self._prev_end if self._prev_end is not None else self.stamp())

    def _adapt_bucket_every(self, cost_ns: int) -> None:
        """Space detailed steps so their hook time stays within BUCKET_BUDGET.

        ``cost_ns`` is the wall time the comm hook took on a detailed step.
        It includes the all-reduce launch every step pays, so the interval
        errs long. The median of the last few keeps one slow step (a page
        fault, the thread descheduled on a busy host) from moving it at all.
        """
        if self.step < _MAP_STEPS:
            return
        costs = self._detail_costs
        costs.append(cost_ns)
        est = sorted(costs)[len(costs) // 2]
        median = self.median_step_ns()
        if median <= 0:
            return
        need = est / (BUCKET_BUDGET * median)
        every = 1
        while every < need and every < MAX_BUCKET_EVERY:
            every *= 2
        self.bucket_every = every

    def median_step_ns(self) -> int:
        return self._median

    def _note_step_time(self, step: int, ns: int) -> None:
        recent = self._recent
        recent.append(ns)
        if not step & 7 or len(recent) < _RECENT_STEPS:
            # Sorted every 8th step only: the consumers (sampling intervals)
            # react to trends, not to one step.
            ordered = sorted(recent)
            self._median = ordered[len(ordered) // 2]

    def _post_layout(self, end: int) -> None:
        self._layout_dirty = False
        self.layout_gen += 1
        self._layout_step = self.step
        fields = self.layout_fields(sorted(self._layout))
        # Stamped with the step's end (its message's time), not when queued: the
        # layout goes out just before that step's message, and a later time put
        # it after the step in a recording read in time order, where the step's
        # sequence number then showed a message missing until it came (a
        # replay's first screen said "dropped 1").
        fields["t"] = self.clock.host_ns(end)
        self.pub.post(BucketLayout.KIND, self.model_index, fields)

    def layout_fields(self, indices: list[int] | None = None) -> dict[str, Any]:
        indices = sorted(self._layout) if indices is None else indices
        return {
            "generation": self.layout_gen,
            "step": self._layout_step + self.step_base,
            "index": indices,
            "nbytes": [self._layout[i] for i in indices],
            "dtype": [self._layout_dtype[i] for i in indices],
            "params": [self._layout_params[i] for i in indices],
        }

    # --- publisher thread ----------------------------------------------------

    def finish(self, rec: StepRecord, force: bool) -> dict[str, Any] | None:
        iv, b_start, b_end, colls = rec.intervals, rec.b_start, rec.b_end, rec.collectives
        start, end = rec.start, rec.end
        clock = self.clock
        if -1 in b_end and not force:
            return None
        if self._cpu:
            # Host clock: every token is its own time, so nothing is resolved and
            # the intervals are the spans. This runs on the publisher thread every
            # step, and that thread's Python time is taken from training's GIL.
            at: Callable[[int], int] = int
            t_start, t_end = start, end
            spans = iv
        else:
            device_tokens = [tok for kind, a, b in iv if kind != DATA for tok in (a, b)]
            device_tokens += b_start
            device_tokens += [t for t in b_end if t >= 0]
            device_tokens += [tok for c in colls for tok in (c[5], c[6])]
            times = clock.resolve(device_tokens, force)
            if times is None:
                return None
            at = dict(zip(device_tokens, times, strict=True)).__getitem__
            t_start, t_end = clock.host_ns(start), clock.host_ns(end)
            host = clock.host_ns
            spans = [
                (kind, host(a), host(b)) if kind == DATA else (kind, at(a), at(b))
                for kind, a, b in iv
            ]
        if rec.step >= _RECENT_STEPS:
            self._note_step_time(rec.step, t_end - t_start)
        sums = dict.fromkeys(_PHASE_FIELD.values(), 0)
        data = 0
        for kind, lo, hi in spans:
            if kind == DATA:
                data += hi - lo
            else:
                sums[_PHASE_FIELD[kind]] += hi - lo
        # Evaluation between steps falls inside the gap before the next
        # forward; it is not waiting for data, so it moves to "other".
        data = max(0, data - rec.eval_ns)
        sync_wait, coll_wait, data_out = self._collective_waits(colls, at, spans, sums)
        data = max(0, data - data_out)
        if rec.fetch_calls:
            # The loop draws from a DataLoader on this thread: the rest of the gap
            # is its own code (logging, callbacks, a checkpoint), "other".
            data = min(data, rec.fetch_ns)
        offsets = [at(t) - t_start for t in b_start]
        durations = [at(e) - at(s) if e >= 0 else -1 for s, e in zip(b_start, b_end, strict=True)]
        accounted = data + sum(sums.values()) + sync_wait + coll_wait
        fields: dict[str, Any] = {
            "step": rec.step + self.step_base,
            "t_start": t_start,
            "t_end": t_end,
            "data_ns": data,
            "other_ns": max(0, t_end - t_start - accounted),
            "micro_batches": rec.micro_batches,
            "optimizer_steps": rec.optimizer_steps,
            "epoch": rec.epoch,
            "loader_pass": rec.loader_pass,
            "layout": rec.layout,
            "b_index": rec.b_index,
            "b_nbytes": rec.b_nbytes,
            "b_offset_ns": offsets,
            "b_dur_ns": durations,
            "b_detail": rec.b_detail,
            "b_every": rec.b_every,
            "clock": clock.name,
            "t": t_end,
            "sync_wait_ns": sync_wait,
            "coll_wait_ns": coll_wait,
            "join": rec.joined,
        }
        if rec.unsynced:
            fields["unsynced"] = True
        if rec.bypassed:
            fields["bypassed"] = True
        if rec.batch_digest:
            fields["batch_digest"] = rec.batch_digest
        if rec.drawn:
            fields["drawn"] = True
        if rec.worker_copies:
            fields["worker_copies"] = rec.worker_copies
        if rec.search_ns >= 0:
            fields["search_ns"] = rec.search_ns
            fields["unused_params"] = rec.unused_params
            if rec.unused_set:
                fields["unused_set"] = rec.unused_set
            if rec.unused_names:
                fields["unused_names"] = list(rec.unused_names)
        if rec.eval_mode:
            fields["eval_mode"] = True
            if rec.eval_layers is not None:
                fields["eval_layers"] = list(rec.eval_layers)
        if rec.pass_repeat is not None:
            layer, before, now, shared, persistent = rec.pass_repeat
            fields["pass_repeat"] = layer
            fields["pass_epochs"] = [before, now]
            fields["epoch_shared"] = shared
            fields["persistent_workers"] = persistent
        if rec.replayed:
            fields["replayed"] = rec.replayed
            fields["replay_of"] = rec.replay_of
            fields["replay_pass"] = rec.replay_pass
        if colls:
            listed = colls[:MAX_STEP_COLLECTIVES]
            fields["c_op"] = [c[1] for c in listed]
            fields["c_class"] = ["ddp" if c[0] else "user" for c in listed]
            fields["c_group"] = [c[2] for c in listed]
            fields["c_nbytes"] = [c[3] for c in listed]
            fields["c_offset_ns"] = [at(c[5]) - t_start for c in listed]
            fields["c_dur_ns"] = [at(c[6]) - at(c[5]) for c in listed]
            fields["c_site"] = [c[4] for c in listed]
            fields["c_more"] = len(colls) - len(listed) + rec.collectives_lost
        fields.update(sums)
        return fields

    @staticmethod
    def _collective_waits(
        colls: list[Collective],
        at: Callable[[int], int],
        spans: list[tuple[int, int, int]],
        sums: dict[str, int],
    ) -> tuple[int, int, int]:
        """Sum the waits by class and take each out of the phase it interrupted.

        Returns (DDP sync wait, user collective wait, time to take out of
        data). ``at`` gives a token's time; ``sums`` is changed in place. A
        collective in no phase was in "other", which is what remains of the
        step; one inside an evaluation forward is already out of data with the
        evaluation.
        """
        sync_wait = coll_wait = data_out = 0
        for is_ddp, _op, _group, _nbytes, _site, a, b, in_eval in colls:
            begin = at(a)
            dur = max(0, at(b) - begin)
            if is_ddp:
                sync_wait += dur
            else:
                coll_wait += dur
            if in_eval:
                continue
            for kind, lo, hi in spans:
                if lo <= begin <= hi:
                    if kind == DATA:
                        data_out += dur
                    else:
                        name = _PHASE_FIELD[kind]
                        sums[name] = max(0, sums[name] - dur)
                    break
        return sync_wait, coll_wait, data_out

    def fail(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            self.cheap = False
            log.warning("ddpscope disabled on this rank after an internal error: %r", exc)
            self.pub.close("disabled", f"{type(exc).__name__}: {exc}")
