"""A GGUF file's header walked with every count bounded, before the gguf reader sees it
(``check_layout``): the reader trusts each count it reads."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from .. import files


class GGUFError(ValueError):
    """A GGUF file nbtune cannot read or a model it cannot write as GGUF, with the way out."""


# GGUF metadata value types of fixed size -> struct format (gguf.GGUFValueType's numbering)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
          11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_INTEGER_TENSORS = ("I8", "I16", "I32", "I64")  # weights are floating point, quantized or not


def _damaged(path, what: str) -> GGUFError:
    return GGUFError(f"{path} is damaged, crafted or not a GGUF file: {what}. Download or "
                     "export it again.")


class _Header:
    """``check_layout``'s walk over one GGUF file's mapped bytes: every read bounded by the
    file's size and ``files.LIMITS``, refused with ``bad``."""

    def __init__(self, path: Path, data: mmap.mmap, size: int, max_items: int, max_string: int):
        self.path, self.data, self.size = path, data, size
        self.max_items, self.max_string = max_items, max_string

    def bad(self, what: str) -> GGUFError:
        return _damaged(self.path, what)

    def take(self, fmt: str, at: int):
        if at + struct.calcsize(fmt) > self.size:
            raise self.bad(f"it ends inside its header (byte {at})")
        return struct.unpack_from(fmt, self.data, at)

    def string(self, at: int) -> tuple[str, int]:
        (length,) = self.take("<Q", at)
        if length > min(self.max_string, self.size - at - 8):
            raise self.bad(f"a string at byte {at} claims {length} bytes")
        raw = bytes(self.data[at + 8:at + 8 + length])
        try:
            return raw.decode("utf-8"), at + 8 + length
        except UnicodeDecodeError:
            raise self.bad(f"the string at byte {at} is not UTF-8") from None

    def value(self, kind: int, at: int, depth: int = 0) -> tuple[object, int]:
        if kind in _FIXED:
            return self.take(_FIXED[kind], at)[0], at + struct.calcsize(_FIXED[kind])
        if kind == _STRING:
            return self.string(at)
        if kind == _ARRAY and depth == 0:
            item, count = self.take("<IQ", at)
            at += 12
            least = struct.calcsize(_FIXED[item]) if item in _FIXED else 8  # a string: its length
            if count > self.max_items or count * least > self.size - at:
                raise self.bad(f"an array at byte {at - 12} declares {count} items, more than "
                               f"the file holds (limit {self.max_items})")
            if item in _FIXED:
                return None, at + count * least
            for _ in range(count):
                _, at = self.value(item, at, depth + 1)
            return None, at
        raise self.bad(f"unknown metadata type {kind} at byte {at}")

    def metadata(self, alignment: int) -> tuple[int, int, object]:
        """(tensor count, the byte where the tensor infos start, general.alignment or
        ``alignment``): the fixed header and every metadata entry, walked."""
        magic, version, tensors, entries = self.take("<4sIQQ", 0)
        if magic != b"GGUF":
            raise self.bad("it does not start with GGUF")
        if version not in (2, 3):
            raise self.bad(f"GGUF version {version} (nbtune reads 2 and 3)")
        if tensors > self.max_items or entries > self.max_items or (tensors + entries) * 12 > self.size:
            raise self.bad(f"it declares {tensors} tensors and {entries} metadata entries")
        at = 24
        for _ in range(entries):
            key, at = self.string(at)
            (kind,) = self.take("<I", at)
            found, at = self.value(kind, at + 4)
            if key == "general.alignment":
                alignment = found
        return tensors, at, alignment

    def tensor_spans(self, tensors: int, at: int) -> tuple[list[tuple[int, int, str]], int]:
        """(offset, end, name) of each of the ``tensors`` infos from byte ``at`` (end relative
        to the data section, like offset), and the byte after them."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        spans = []
        for _ in range(tensors):
            name, at = self.string(at)
            (dims,) = self.take("<I", at)
            if not 1 <= dims <= 4:
                raise self.bad(f"tensor {name!r} has {dims} dimensions (GGUF allows 1 to 4)")
            shape = self.take(f"<{dims}Q", at + 4)
            kind, offset = self.take("<IQ", at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            try:
                ggml = GGMLQuantizationType(kind)
            except ValueError:
                raise self.bad(f"tensor {name!r} has unknown type {kind}") from None
            if ggml.name in _INTEGER_TENSORS:
                raise self.bad(f"tensor {name!r} holds integers ({ggml.name}); model weights are "
                               "floating point")
            block, type_size = GGML_QUANT_SIZES[ggml]
            count = 1
            for n in shape:
                count *= n
            if not all(shape) or count % block or count // block * type_size > self.size:
                raise self.bad(f"tensor {name!r} has shape {list(shape)}, which is empty, not a whole "
                               f"number of {ggml.name} blocks, or larger than the file")
            spans.append((offset, offset + count // block * type_size, name))
        return spans, at

    def check_spans(self, spans: list[tuple[int, int, str]], start: int, alignment: int) -> None:
        """Every tensor inside the file from the data section at ``start``, aligned, none
        overlapping another."""
        for offset, end, name in spans:
            if offset % alignment or start + end > self.size:
                raise self.bad(f"tensor {name!r} lies "
                               f"{'outside the file' if start + end > self.size else 'unaligned'}"
                               f" (offset {offset}, alignment {alignment})")
        spans.sort()
        for (_, end, first), (offset, _, second) in zip(spans, spans[1:]):
            if offset < end:
                raise self.bad(f"tensors {first!r} and {second!r} overlap")


def check_layout(path: Path) -> None:
    """Walk a GGUF file's header with every count bounded before the gguf reader sees it.

    The reader loops over each declared array item and each tensor, so a metadata array
    declared 2**60 long runs for ever; counts are checked here against the bytes left and
    ``files.LIMITS``. Tensors must lie inside the data section, aligned, not overlapping,
    and be floating point (quantized or not).
    """
    from gguf.constants import GGUF_DEFAULT_ALIGNMENT

    max_items, max_string = files.limit("gguf_array_items"), files.limit("gguf_string_bytes")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise _damaged(path, f"it is {size} bytes, shorter than a GGUF header")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with data:
        header = _Header(path, data, size, max_items, max_string)
        tensors, at, alignment = header.metadata(GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise header.bad(f"general.alignment is {alignment!r}, not a power of two")
        spans, at = header.tensor_spans(tensors, at)
        header.check_spans(spans, at + (-at) % alignment, alignment)
