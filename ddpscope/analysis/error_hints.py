"""What to do about an error a rank raised, where its cause is a known DDP pitfall.

The fix texts of ``rank_exit`` for torch errors whose message leaves the user
without the way out: an internal assert that asks for a bug report, a list
of parameter indices, a generic list of reasons. Read from the whole
traceback (the end message's), with the run info's DDP settings and
parameter names; no torch here.
"""

from __future__ import annotations

import re
from typing import Any

_NO_GRAD = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")
_TWICE = re.compile(r"Parameter at index (\d+)(?: with name (\S+))? has been marked as ready twice")
#: Parameter names quoted in a fix.
NAMES_QUOTED = 6


def known_fix(ddp: dict[str, Any], params: list[list[Any]], error: str) -> str:
    """The fix for ``error`` (a whole traceback) when its cause is a known pitfall, else ''."""
    if "expect_autograd_hooks_" in error and ddp.get("static_graph"):
        return (
            "DDP(static_graph=True) raises this internal assert when a backward runs that DDP "
            "did not prepare for: under no_sync(), as gradient accumulation does "
            "(pytorch/pytorch#143580), or a second backward through one forward's outputs "
            "(#106953). Build DDP without static_graph=True "
            "(Hugging Face Trainer: ddp_static_graph=False), or accumulate without no_sync()."
        )
    if "Expected to have finished reduction in the prior iteration" in error:
        return _unused_fix(ddp, params, error)
    if "Expected to mark a variable ready only once" in error:
        return _twice_fix(ddp, error)
    if 'Unexpected key(s) in state_dict: "module.' in error:
        return (
            "The checkpoint was saved from the DDP wrapper (model.state_dict() of the "
            "DistributedDataParallel model): every key carries the 'module.' prefix, and this "
            "model has none. Load it into the wrapper (ddp_model.load_state_dict(state)), or "
            "strip the prefix first: "
            "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.'); "
            "save model.module.state_dict() from now on."
        )
    if 'Missing key(s) in state_dict: "module.' in error:
        return (
            "The state_dict is being loaded into the DDP wrapper, whose keys carry the "
            "'module.' prefix, but it was saved from the plain model. Load it into the wrapped "
            "model instead: ddp_model.module.load_state_dict(state) (or into the model before "
            "wrapping it in DDP)."
        )
    return ""


def _unused_fix(ddp: dict[str, Any], params: list[list[Any]], error: str) -> str:
    m = _NO_GRAD.search(error)
    names = _names_at([int(i) for i in m[1].split()], params) if m else []
    which = f" ({_quote(names)})" if names else ""
    if ddp.get("find_unused_parameters"):
        return (
            f"Some parameters got no gradient in the last backward{which} although DDP was "
            "built with find_unused_parameters=True: DDP could not find the tensors the "
            "forward returned (an output hidden in an object DDP does not walk). Return "
            "tensors, or lists, tuples and dicts of them, from forward."
        )
    return (
        f"Some parameters got no gradient in the last backward{which}, and DDP waits for "
        "every parameter's before it finishes a step. Make each one count in the loss (a head "
        "used every other step, a branch behind an if, a layer the loss never reaches; freeze "
        "what is not trained with requires_grad=False before wrapping in DDP), or build DDP "
        "with find_unused_parameters=True (a graph walk per step; Hugging Face Trainer: "
        "ddp_find_unused_parameters=True; Lightning: "
        "strategy='ddp_find_unused_parameters_true'), or static_graph=True when the same "
        "parameters go unused every step."
    )


def _twice_fix(ddp: dict[str, Any], error: str) -> str:
    m = _TWICE.search(error)
    which = f" ({m[2]})" if m and m[2] else ""
    if ddp.get("find_unused_parameters"):
        return (
            f"A parameter{which} was marked ready twice in one step: reentrant activation "
            "checkpointing (torch.utils.checkpoint with use_reentrant=True, the default of "
            "older Hugging Face gradient_checkpointing) runs a backward inside DDP's, which "
            "find_unused_parameters=True cannot follow. Checkpoint with use_reentrant=False "
            "(Hugging Face: gradient_checkpointing_kwargs={'use_reentrant': False}), or build "
            "DDP with find_unused_parameters=False (ddp_find_unused_parameters=False) or "
            "static_graph=True."
        )
    return (
        f"A parameter{which} took part in two backward passes of one step: reentrant "
        "activation checkpointing of the same module twice, or a module shared between two "
        "forwards whose losses are backpropagated apart. Checkpoint with "
        "use_reentrant=False, sum the losses into one backward, or build DDP with "
        "static_graph=True when the graph is the same every step."
    )


def _names_at(indices: list[int], params: list[list[Any]]) -> list[str]:
    """Names of DDP's parameter indices: those that require grad, in module order."""
    trained = [str(p[0]) for p in params if len(p) < 4 or p[3]]
    return [trained[i] for i in indices if 0 <= i < len(trained)]


def _quote(names: list[str]) -> str:
    text = ", ".join(names[:NAMES_QUOTED])
    more = len(names) - NAMES_QUOTED
    return text + (f" and {more} more" if more > 0 else "")
