"""How the hooks name an object's type in what they send and say: its module and
qualified name (``torch.utils.data.distributed.DistributedSampler``)."""

from __future__ import annotations


def type_name(obj: object) -> str:
    """The module-qualified name of ``obj``'s type."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


__all__ = ["type_name"]
