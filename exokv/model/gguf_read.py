"""Reading a GGUF file: its metadata, and its tensors as MLX arrays.

``mx.load`` reads GGUF natively: Q4_0, Q4_1 and Q8_0 tensors come back as MLX
affine-quantized arrays (weight, scales, biases; groups of 32), so they stay
exactly the file's; F32, F16 and BF16 come back as they are. Other types are
decoded by the ``gguf`` package (llama.cpp's reference decoders) and quantized
again with MLX at about their bits.
"""

from __future__ import annotations

import contextlib
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from exokv.errors import ExokvError, one_line

GGUF_MAGIC = b"GGUF"
GROUP_SIZE = 32
# GGUF types kept as they are: floats, and what mx.load gives as MLX quantized arrays.
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
NATIVE_TYPES = {"F32": 32, "F16": 16, "BF16": 16, "Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# Types mx.load reads only by casting to float16 (its Q4_K decoding differs from
# llama.cpp's): decoded by the gguf package like the ones it cannot read.
MLX_CASTS = ("Q2_K", "Q4_K", "Q6_K")
# Raw bytes of a tensor decoded at once (a piece of rows; see _decoded).
_PIECE_BYTES = 8 << 20
# Types decoded by the gguf package and quantized again, at about their bits per weight.
REQUANTIZED = {
    "Q5_0": 5, "Q5_1": 5, "Q2_K": 3, "Q3_K": 4, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6,
    "IQ4_NL": 4, "IQ4_XS": 4, "IQ3_XXS": 4, "IQ3_S": 4, "IQ2_XXS": 3, "IQ2_XS": 3, "IQ2_S": 3,
}  # fmt: skip


def is_gguf(path: Path) -> bool:
    """A regular file that starts with the GGUF magic (a .gguf, or an ollama blob)."""
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(
    path: Path, on_tensor: Callable[[int, int], None] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, metadata): tensors as mx arrays, quantized ones in MLX's affine format.

    ``on_tensor(done, total)`` runs first with 0 (the file's types are known to
    be readable) and then after each tensor is read, in bytes of the file's
    tensor data: the decoding is most of a conversion's time, and each tensor is
    evaluated before the next so the count follows the work (and the decoded
    floats are freed as it goes).

    Q4_0, Q4_1 and Q8_0 come from ``mx.load`` as MLX quantized arrays, exactly.
    Other quantized types (Q4_K, Q6_K, Q5_0, ...) are decoded by the ``gguf``
    package (llama.cpp's own reference decoders) and quantized again with MLX at
    the closest bit width: mlx reads some of them only by casting, some not at all.
    """
    reader = _reader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    _check_types(path, reader)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    done = 0
    if on_tensor is not None:
        on_tensor(done, total)
    loaded = _loaded_natively(path, reader)
    tensors: dict[str, Any] = {}

    def step(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if on_tensor is not None:
            on_tensor(done, total)

    for tensor in reader.tensors:
        name, kind = tensor.name, tensor.tensor_type.name
        if kind in NATIVE_TYPES and name in loaded:
            base = name.removesuffix(".weight")
            parts = [name] + [
                f"{base}.{p}" for p in ("scales", "biases") if name.endswith(".weight")
            ]
            read = {key: loaded[key] for key in parts if key in loaded}
            step(int(tensor.n_bytes))
        else:
            read = _decoded(tensor, kind, step)
        mx.eval(list(read.values()))
        tensors.update(read)
    return tensors, metadata


def _reader(path: Path) -> Any:
    """The gguf package's reader of ``path`` (a GGUFReader)."""
    # deferred: gguf brings numpy (~0.2 s); every chat imports this module for is_gguf
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise ExokvError(f"{path} is not a readable GGUF file: {one_line(e, named=False)}") from e


def _check_types(path: Path, reader: Any) -> None:
    """An error naming the tensor types of the file exokv cannot read, if any."""
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    unsupported = sorted({k.name for k in kinds.values() if _bits_for(k.name) is None})
    if unsupported:
        raise ExokvError(
            f"{path}: GGUF tensor type {', '.join(unsupported)} is not supported; supported: "
            f"{', '.join(NATIVE_TYPES)} (kept as they are) and "
            f"{', '.join(REQUANTIZED)} (quantized again for MLX)"
        )


def _loaded_natively(path: Path, reader: Any) -> dict[str, Any]:
    """What ``mx.load`` reads of the file, exactly; nothing if it holds a type mx.load
    cannot read at all (Q5_0, ...): mx.load refuses the whole file then, and every
    tensor is decoded, the kept types too."""
    kinds = [t.tensor_type.name for t in reader.tensors]
    if not all(k in NATIVE_TYPES or k in MLX_CASTS for k in kinds):
        return {}
    try:
        with _gguf_named(path) as named:
            loaded: dict[str, Any] = mx.load(str(named))
    except Exception as e:  # noqa: BLE001 - mlx raises plain exceptions for bad files
        raise ExokvError(f"cannot read the GGUF file {path}: {one_line(e, named=False)}") from e
    return loaded


@contextlib.contextmanager
def _gguf_named(path: Path) -> Iterator[Path]:
    """``path``, or a link to it ending in .gguf: mx.load picks the format by extension."""
    if path.suffix == ".gguf":
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="exokv-gguf-") as tmp:
        link = Path(tmp) / "model.gguf"
        link.symlink_to(path.resolve())
        yield link


def _decoded(tensor: Any, kind: str, step: Callable[[int], None]) -> dict[str, Any]:
    """One tensor decoded by the gguf package; quantized types quantized again for MLX.

    A 2-D quantized tensor is decoded a few megabytes of rows at a time, each
    quantized again before the next (groups run along a row, so the result is the
    one of the whole): the float copy stays small, and ``step(bytes)`` reports each
    piece, so a large embedding does not hold the progress still.
    """
    # deferred: numpy and gguf (~0.2 s), as in _reader
    import numpy as np
    from gguf import quants

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data
    bits = _bits_for(kind)
    if kind in FLOAT_TYPES or len(shape) != 2 or shape[-1] % GROUP_SIZE or data.ndim != 2:
        values = np.asarray(quants.dequantize(data, tensor.tensor_type)).reshape(shape)
        step(int(tensor.n_bytes))
        if kind in FLOAT_TYPES:
            return {tensor.name: mx.array(values).astype(getattr(mx, FLOAT_TYPES[kind]))}
        return {tensor.name: mx.array(values.astype(np.float32)).astype(mx.float16)}
    rows = max(1, _PIECE_BYTES // max(int(data.shape[1]), 1))
    parts: list[tuple[Any, Any, Any]] = []
    for start in range(0, shape[0], rows):
        raw = data[start : start + rows]
        values = np.asarray(quants.dequantize(raw, tensor.tensor_type), dtype=np.float32)
        array = mx.array(values).astype(mx.float16)
        part = mx.quantize(array, group_size=GROUP_SIZE, bits=bits)
        mx.eval(part)
        parts.append(part)
        step(int(raw.nbytes))
    weight, scales, biases = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    base = tensor.name.removesuffix(".weight")
    return {tensor.name: weight, f"{base}.scales": scales, f"{base}.biases": biases}


def _bits_for(kind: str) -> int | None:
    """MLX bits for a GGUF type: its own for the kept ones, the closest for the others."""
    if kind in FLOAT_TYPES:
        return 16
    return NATIVE_TYPES.get(kind) or REQUANTIZED.get(kind)


# --- a quick look at a file ---------------------------------------------------------------

# GGUF metadata value types: fixed sizes (struct formats); 8 is a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def gguf_header(path: Path, wanted: tuple[str, ...]) -> dict[str, Any]:
    """The scalar metadata ``wanted`` (e.g. general.architecture), read without the tensors.

    For listings: the gguf package's reader parses every array of the file
    (a vocabulary of 150,000 strings) before giving one key. Stops once all are found.
    """
    try:
        return _read_header(path, wanted)
    except (struct.error, UnicodeDecodeError, ValueError, MemoryError, OverflowError) as e:
        raise ExokvError(f"{path} is not a readable GGUF file: {one_line(e, named=False)}") from e


def _read_header(path: Path, wanted: tuple[str, ...]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    with open(path, "rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def skip(kind: int) -> Any:
            if kind == _STRING:
                return f.read(read("Q")).decode("utf-8", "replace")
            if kind == _ARRAY:
                inner, count = read("I"), read("Q")
                if inner in _SCALARS:
                    f.seek(count * struct.calcsize("<" + _SCALARS[inner]), 1)
                else:
                    for _ in range(count):
                        skip(inner)
                return None
            return read(_SCALARS[kind])

        if f.read(4) != GGUF_MAGIC:
            raise ExokvError(f"{path} is not a GGUF file")
        _version, _tensors, count = read("I"), read("Q"), read("Q")
        for _ in range(count):
            key = f.read(read("Q")).decode("utf-8", "replace")
            value = skip(read("I"))
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found


def value_of(value: Any) -> Any:
    """A metadata value as plain Python (arrays as lists)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def text(value: Any) -> str | None:
    return value if isinstance(value, str) or value is None else str(value_of(value))
