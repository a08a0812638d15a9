"""The record file format, shared by the writer and the reader.

    file    := MAGIC version:u16 flags:u16 header_len:u32 header header_crc:u32 record*
    record  := length:u32 crc:u32 payload

All integers little-endian. ``header`` is a msgpack map (run id, rank, world
size, host, pid, clock anchors, versions). ``payload`` is one wire message,
byte for byte what went over ZeroMQ. ``crc`` is CRC-32 of the payload, so a
torn write at the tail is detected and reported instead of misread.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"DDPSCOPE"
FORMAT_VERSION = 1
SUFFIX = ".ddps"

PREAMBLE = struct.Struct("<8sHHI")  # magic, version, flags, header length
U32 = struct.Struct("<I")
RECORD_HEAD = struct.Struct("<II")  # payload length, crc32

#: A header or record larger than this is corruption, not data.
MAX_HEADER_BYTES = 1 << 20
MAX_RECORD_BYTES = 64 << 20


class RecordError(Exception):
    """A record file or directory that ddpscope cannot read."""


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def rank_file_name(rank: int, pid: int) -> str:
    # The pid keeps two processes claiming one rank (a restarted worker that
    # kept the run id) from writing into one file.
    return f"rank-{rank:05d}-{pid}{SUFFIX}"
