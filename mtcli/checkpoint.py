"""The checkpoint file: atomic save with a checksum, and a weights-only load that verifies it.

File format
-----------
A checkpoint file is one header line followed by the payload::

    MTCLI-CHECKPOINT 1 sha256=<64 hex digits> size=<payload bytes>\\n
    <payload: the bytes of torch.save(state)>

The header and the payload are written together to a temporary file in the same directory,
flushed (``fsync``) and renamed over the target, so a crash or a full disk leaves either the
old file or the new one. On load, the payload length and ``sha256(payload)`` are checked
before a single byte is deserialised: a truncated or bit-flipped file raises
:class:`~mtcli.errors.CheckpointError` ("checksum mismatch"). The payload is then read with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers: a pickle
crafted to run code (``__reduce__``) is refused, and a file without the header (for example a
raw pickle) is refused before it is parsed at all. A valid checksum only proves the file is
the one that was written, not that it is benign, so both checks always run.

Because of ``weights_only``, a state may hold only tensors, ``dict``/``list``/``tuple``/``set``,
``str``/``bytes``/``int``/``float``/``bool``/``None`` and ``torch.Size``/``dtype``/``device``;
:func:`save_checkpoint` checks this before writing, naming the offending key (store a numpy
RNG state as ``np.random.get_state()[1].tolist()`` and friends, not as arrays).

State layout (written by the trainer)::

    {"format": 1, "step": int, "epoch": int, "model": state_dict, "optimizer": ...,
     "scheduler": ..., "rng": {...}, "data_state": {...}, "train_state": {...},
     "config": Config.to_dict(), "vocab": {"size": int, "spm_sha256": str},
     "valid": {"loss": float, "bleu": float | None}}
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtcli.config import ModelConfig
from mtcli.errors import CheckpointError, failed_to_allocate, one_line, shown
from mtcli.fileio import atomic_link, atomic_write

# torch is imported where a checkpoint is written or read: the modules that only name a run's
# files (mtcli.rundir, and through it mtcli prepare) start without its two seconds of imports
if TYPE_CHECKING:
    import torch

FORMAT = 1
MAGIC = b"MTCLI-CHECKPOINT"
_HEADER_RE = re.compile(rb"^MTCLI-CHECKPOINT (\d+) sha256=([0-9a-f]{64}) size=(\d+)$")
_MAX_HEADER = 256

@functools.cache
def _plain_types() -> tuple[type, ...]:
    """Types torch.load(weights_only=True) rebuilds; save_checkpoint refuses anything else."""
    import torch

    return (str, bytes, int, float, bool, complex, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)


def _check_plain(obj: Any, where: str) -> None:
    """Raise :class:`CheckpointError` if ``obj`` holds a type weights-only loading refuses."""
    if isinstance(obj, _plain_types()):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str | int | float | bool | tuple | type(None)):
                raise CheckpointError(f"{where}: key {key!r} of type {type(key).__name__} cannot be saved")
            _check_plain(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, list | tuple | set | frozenset):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
        return
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise CheckpointError(
        f"{where}: a {kind} cannot be loaded back with weights_only=True; "
        "store tensors, lists or plain numbers instead"
    )


def _frame(payload: bytes | memoryview) -> bytes:
    """Header line (format, sha256, size) for ``payload``."""
    digest = hashlib.sha256(payload).hexdigest()
    return MAGIC + f" {FORMAT} sha256={digest} size={len(payload)}\n".encode("ascii")


#: The model keys that decide the parameters' names and shapes and what they compute: the
#: weights of one model are read only by a model of the same values.
ARCHITECTURE_KEYS = ("d_model", "n_heads", "encoder_layers", "decoder_layers", "d_ff", "pre_norm",
                     "tie_embeddings", "activation", "output_bias")


def architecture_mismatches(saved: Any, ours: ModelConfig | dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved's value, ours)`` for each :data:`ARCHITECTURE_KEYS` value in which ``saved``
    (a checkpoint's ``config["model"]``, a dict; anything else is not compared) differs from
    ``ours`` (a model's settings, or another checkpoint's); a key either lacks is not compared."""
    if not isinstance(saved, dict):
        return []
    ours = ours if isinstance(ours, dict) else dataclasses.asdict(ours)
    return [(key, saved[key] if isinstance(saved[key], int | float | str | None) else shown(saved[key]), ours[key])
            for key in ARCHITECTURE_KEYS if key in saved and key in ours and saved[key] != ours[key]]


def trained_directions(data: Any) -> list[tuple[str, str]] | None:
    """The translation directions a config's ``data`` section (a dict, as a checkpoint keeps it)
    trains, sorted: each corpus of ``data.sources`` (its ``langs``, else the run's pair), or the
    run's ``src_lang -> tgt_lang``; None where it records none (an older checkpoint)."""
    if not isinstance(data, dict) or not data.get("src_lang") or not data.get("tgt_lang"):
        return None
    pair = (str(data["src_lang"]), str(data["tgt_lang"]))
    corpora = [c for c in data.get("sources") or [] if isinstance(c, dict)]
    found = {tuple(map(str, c["langs"][:2])) if len(c.get("langs") or []) >= 2 else pair for c in corpora}
    return sorted(found or {pair})  # type: ignore[arg-type]


def other_directions(ours: Any, theirs: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]] | None:
    """``(ours, theirs)``'s :func:`trained_directions` when both say and they differ, else None:
    weights of one direction decoded as another's translate nonsense without a word."""
    mine, other = trained_directions(ours), trained_directions(theirs)
    return (mine, other) if mine is not None and other is not None and mine != other else None


def directions_text(directions: list[tuple[str, str]]) -> str:
    """``en->de, de->en`` for messages."""
    return ", ".join(f"{src}->{tgt}" for src, tgt in directions)


def save_checkpoint(path: Path, state: dict, also: Iterable[Path] = (), *, follow: bool = False) -> None:
    """Write ``state`` to ``path`` atomically, with a sha256 of the payload in a header line.

    The state is checked to hold only types :func:`load_checkpoint` can read back, serialised
    with ``torch.save`` to memory, then header + payload go to a temporary file in the same
    directory, which is fsynced and renamed over ``path``; each of ``also`` then becomes another
    name of that file (:func:`mtcli.fileio.atomic_link`). If anything fails (disk full, file-size
    limit, permissions) the temporary file is removed, the previous file is untouched, and
    :class:`CheckpointError` names the path and the OS error, and the files of these names that
    were there before and are unchanged. ``follow``: ``path`` is the user's own (``average -o``),
    written through a link (see :func:`~mtcli.fileio.atomic_write`).
    """
    path = Path(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: a checkpoint state must be a dict, got {type(state).__name__}")
    import torch

    _check_plain(state, f"{path}: state")
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as exc:  # pickling failures come in many types
        if failed_to_allocate(exc):  # not the state's fault: the file before it stays as it was
            raise MemoryError(f"{path}: serialising the checkpoint ({one_line(exc)})") from None
        raise CheckpointError(f"{path}: cannot serialise checkpoint ({one_line(exc)})") from None
    payload = buffer.getbuffer()
    target = path
    also = list(map(Path, also))
    existed = {p for p in (path, *also) if os.path.isfile(p)}  # a failed write leaves these as they were
    try:
        with atomic_write(path, "wb", follow=follow) as handle:
            handle.write(_frame(payload))
            handle.write(payload)
        for target in also:
            atomic_link(path, target)
    except OSError as exc:
        reason = exc.strerror or one_line(exc)
        kept = [p.name for p in (path, *also) if p in existed]  # the files a reader finds, as they were
        unchanged = f"; {' and '.join(kept)} {'is' if len(kept) == 1 else 'are'} unchanged" if kept else ""
        raise CheckpointError(f"{target}: cannot write checkpoint ({reason}){unchanged}") from None
    finally:
        del payload
        buffer.close()


def _unpickling_reason(exc: BaseException) -> str:
    """A short reason for a weights-only refusal, naming the refused global if present."""
    match = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if match:
        return f"it references {match.group(1)}"
    match = re.search(r"Unsupported operand (\d+)", str(exc))
    if match:
        return f"it uses pickle opcode {match.group(1)}"
    return "objects outside the weights-only allowlist"


def is_checkpoint_file(path: Path) -> bool:
    """Whether ``path`` opens as a file :func:`save_checkpoint` writes (its magic; not verified)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _header(data: bytes) -> tuple[int, re.Match[bytes] | None]:
    """Where a checkpoint's header line ends in ``data``, and its match (None: no header)."""
    end = data.find(b"\n", 0, _MAX_HEADER)
    return end, _HEADER_RE.match(data[:end]) if end >= 0 else None


def _verified_payload(path: Path) -> tuple[memoryview, str]:
    """The payload bytes of checkpoint ``path`` and their sha256, as the header records it, after
    checking its header, size and sha256."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint ({exc.strerror or exc})") from None
    except MemoryError:
        raise MemoryError(f"{path}: reading its {os.path.getsize(path) / 2**20:,.0f} MiB") from None
    if not data:
        raise CheckpointError(f"{path}: empty (0 bytes), not a checkpoint")
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data[: len(MAGIC)]):  # empty or cut inside the magic
            raise CheckpointError(f"{path}: checksum mismatch (corrupted or truncated)")
        raise CheckpointError(
            f"{path}: not an mtcli checkpoint (no checksum header); refusing to load an unverified file"
        )
    end, match = _header(data)
    if match is None:
        raise CheckpointError(f"{path}: checksum mismatch (corrupted or truncated)")
    version, digest, size = int(match.group(1)), match.group(2).decode(), int(match.group(3))
    if version > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {version} is newer than this mtcli ({FORMAT})")
    payload = memoryview(data)[end + 1 :]
    if len(payload) != size:
        raise CheckpointError(
            f"{path}: checksum mismatch (corrupted or truncated: {len(payload)} of {size} payload bytes)"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (corrupted or truncated)")
    return payload, digest


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict:
    """Verify and load a checkpoint written by :func:`save_checkpoint`.

    Raises :class:`CheckpointError` (one line, naming ``path``) if the file is missing, has no
    mtcli header, fails the size or sha256 check ("checksum mismatch (corrupted or
    truncated)"), or holds anything ``torch.load(weights_only=True)`` refuses, such as a
    pickle that would run code. Nothing in the file is ever executed.
    """
    return load_checkpoint_with_id(path, map_location)[0]


def weights_sha256(weights: Mapping[str, torch.Tensor]) -> str:
    """The sha256 of a state dict's tensors (names, dtypes, shapes and values, in name order):
    what tells two models apart, whatever else their checkpoint files hold (the optimizer, the
    times, the run directory). A resumed run and the same run straight through have the same."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous().cpu().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(weights[name].shape)}\n".encode())
        digest.update(memoryview(tensor.view(torch.uint8).numpy()))
    return digest.hexdigest()


def load_checkpoint_with_id(path: Path, map_location: Any = "cpu") -> tuple[dict, str]:
    """:func:`load_checkpoint`'s state and the sha256 of the payload it was loaded from (the
    header's, checked against the bytes): what names these weights, whatever happens to the
    file after they were read (a training run saving a new best over it)."""
    import torch

    path = Path(path)
    payload, digest = _verified_payload(path)
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refused: the checkpoint holds more than tensors and plain data "
            f"({_unpickling_reason(exc)}); a checkpoint never runs code"
        ) from None
    except Exception as exc:  # torch raises RuntimeError/ValueError/... for unreadable payloads
        if failed_to_allocate(exc):  # the payload's sha256 matched: the file is sound, the memory short
            raise MemoryError(f"{path}: loading its {len(payload) / 2**20:,.0f} MiB of weights "
                              f"({one_line(exc)})") from None
        raise CheckpointError(f"{path}: unreadable checkpoint payload ({one_line(exc)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: checkpoint holds a {type(state).__name__}, expected a dict")
    fmt = state.get("format", FORMAT)
    if isinstance(fmt, int) and fmt > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt} is newer than this mtcli ({FORMAT})")
    return state, digest


def sha256_of_loaded(path: Path, payload_sha256: str | None) -> str:
    """The sha256 of checkpoint ``path``'s bytes, which must still hold the weights loaded from
    it (``payload_sha256``, as :func:`load_checkpoint_with_id` named them): a record then names
    the file those weights came from. :class:`CheckpointError` when it was replaced meanwhile."""
    data = Path(path).read_bytes()
    match = _header(data)[1]
    if match is None or match.group(2).decode() != payload_sha256:
        raise CheckpointError(f"{path}: replaced while it was being read (a training run saving over it?); "
                              "run again")
    return hashlib.sha256(data).hexdigest()
