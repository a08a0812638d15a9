"""Decoding and validating messages: the first cost of every reader (watch, relay
metrics, report, export, replay).

A synthetic stream (tests/support/synth.py: lockstep DDP, BatchNorm buffer
broadcasts and a per-step loss all-reduce, --buckets buckets, run info and
heartbeats), encoded once, then decoded --rounds times; CPU time of this
thread, so other processes on the machine barely move it. Median and range
over the rounds, per message and in MB/s of encoded bytes.

Each round also decodes the stream with the decoder as it was before the
generated fast decoders (tests/support/schema_before.py), in alternating order,
so that "before" and "after" share the machine's state; ``speedup`` is the
median and range of the per-round ratios. --no-before leaves it out.

``unpack_only`` times msgpack.unpackb alone on the same bytes: the floor under
any decoder that reads msgpack from Python.

--parts splits the generated decoder's time on the step messages (already
unpacked): the whole function, then the same source with one part cut out at
a time (filling the slots, the item-type sets of the lists, the comparison of
the field types); each part's cost is the difference.

--lean leaves out of each message the fields that hold their default, as the
publisher does for a step without collectives or a heartbeat outside one.

    python -m benchmarks.decode [--world 8] [--steps 200] [--buckets 32] [--rounds 9]
                                [--lean] [--parts]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack

from ddpscope import schema
from ddpscope.schema import Message, decode, encode
from tests.support import schema_before, synth


def _round(decoder: Callable[[Any], Any], bufs: list[Any]) -> float:
    began = time.thread_time()
    for b in bufs:
        decoder(b)
    return (time.thread_time() - began) / len(bufs)


def _lean(msg: Message) -> bytes:
    body = msgpack.unpackb(encode(msg))
    for f in dataclasses.fields(msg):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if f.name != "v" and body[f.name] == default:
            del body[f.name]
    return msgpack.packb(body, use_bin_type=True)


#: Parts of the generated step decoder's source, and how to cut each out.
_CUTS: dict[str, tuple[str, str]] = {
    "fill_slots": (r"\n    SET_\d+\(msg, \w+\)", ""),
    "list_item_types": (r"ONLY_\d+\(map\(type, [^\n]*\)\)", "True"),
    "field_types": (r"tuple\(map\(type, vals\)\) != USUAL", "False"),
}


def _parts(bodies: list[dict[str, Any]], rounds: int) -> dict[str, float]:
    """us per step message of the generated decoder, and of each part (see --parts)."""
    whole = schema._FAST["step"]
    variants = {"whole": whole}
    for part, (pattern, repl) in _CUTS.items():
        src, n = re.subn(pattern, repl, whole.__doc__ or "")
        assert n, f"{part} not found in the generated source"
        env = dict(whole.__globals__)
        exec(src, env)
        variants[part] = env["decode_step"]
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(_round(fn, bodies))
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    out = {"whole": round(med["whole"], 2)}
    out.update({k: round(med["whole"] - med[k], 2) for k in _CUTS})
    return out


def _figures(per_msg: list[float], size_per_msg: float) -> dict[str, Any]:
    med = statistics.median(per_msg)
    return {
        "us_per_msg": {"median": round(med * 1e6, 2), "min": round(min(per_msg) * 1e6, 2),
                       "max": round(max(per_msg) * 1e6, 2)},
        "mb_per_s": round(size_per_msg / med / 1e6, 1),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--buckets", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--no-before", action="store_true", help="time only today's decoder")
    p.add_argument("--lean", action="store_true", help="leave out fields that hold their default")
    p.add_argument("--parts", action="store_true", help="split the generated step decoder's time")
    args = p.parse_args()
    msgs = [
        *synth.run_infos(args.world),
        *synth.lockstep(
            args.world, args.steps, synth.constant(), buckets=args.buckets,
            buffers=True, loss_allreduce=True,
        ),
    ]  # fmt: skip
    bufs = [_lean(m) if args.lean else encode(m) for m in msgs]
    size = sum(map(len, bufs))
    after: list[float] = []
    before: list[float] = []
    unpack: list[float] = []
    for i in range(args.rounds):
        unpack.append(_round(msgpack.unpackb, bufs))
        if args.no_before:
            after.append(_round(decode, bufs))
        elif i % 2:
            after.append(_round(decode, bufs))
            before.append(_round(schema_before.decode, bufs))
        else:
            before.append(_round(schema_before.decode, bufs))
            after.append(_round(decode, bufs))
    out: dict[str, Any] = {"messages": len(bufs), "mb": round(size / 1e6, 2)}
    out.update(_figures(after, size / len(bufs)))
    out["unpack_only"] = _figures(unpack, size / len(bufs))
    if before:
        ratios = [b / a for b, a in zip(before, after, strict=True)]
        out["before"] = _figures(before, size / len(bufs))
        out["speedup"] = {"median": round(statistics.median(ratios), 2),
                          "min": round(min(ratios), 2), "max": round(max(ratios), 2)}  # fmt: skip
    if args.parts:
        steps = [msgpack.unpackb(b) for b, m in zip(bufs, msgs, strict=True) if m.KIND == "step"]
        out["step_decoder_us"] = _parts(steps, args.rounds)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
