"""``EmulatedMesh``: where the emulation's device tensors live, a mesh of chips and the submeshes cut from it.

A mesh is a ``rows x cols`` grid of device ids. ``create_submeshes(shape)``
tiles it, row-major, into submeshes of ``shape`` with disjoint device ids,
as ``MeshDevice.create_submeshes`` does (tt-metal's generators split a mesh
into ``MeshShape(1, num_devices // data_parallel)`` submeshes, one model and
one KV cache per data-parallel lane). Every emulated tensor records the mesh
it was placed on or computed on, and ``placement`` is the rule a device
enforces: the tensors one op, copy or trace touches live on one mesh, so a
tensor from one lane's submesh used on another's is an ``EmulationError``.
A replicated tensor holds one copy per device of its mesh.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["EmulatedMesh", "placement"]


def _dims(shape: Any) -> tuple[int, int]:
    dims = tuple(int(d) for d in shape)
    if len(dims) != 2 or min(dims) <= 0:
        from .emulation import EmulationError

        raise EmulationError(f"a mesh shape is two positive dims (rows, cols), got {dims}")
    rows, cols = dims
    return rows, cols


class EmulatedMesh:
    """Stands where a ``MeshDevice`` would be: a grid of device ids (one chip by default)."""

    def __init__(
        self, shape: Any = (1, 1), device_ids: Iterable[int] | None = None, parent: EmulatedMesh | None = None
    ):
        self.shape = _dims(shape)
        rows, cols = self.shape
        self.device_ids = tuple(range(rows * cols) if device_ids is None else device_ids)
        self.parent = parent

    def get_num_devices(self) -> int:
        return len(self.device_ids)

    def get_device_ids(self) -> list[int]:
        return list(self.device_ids)

    def create_submeshes(self, submesh_shape: Any) -> list[EmulatedMesh]:
        """This mesh tiled row-major into submeshes of ``submesh_shape``, each with its own devices."""
        from .emulation import EmulationError

        rows, cols = self.shape
        sub_rows, sub_cols = _dims(submesh_shape)
        if rows % sub_rows or cols % sub_cols:
            raise EmulationError(f"submesh shape {(sub_rows, sub_cols)} does not tile mesh shape {self.shape}")
        grid = [self.device_ids[r * cols : (r + 1) * cols] for r in range(rows)]
        submeshes = []
        for top in range(0, rows, sub_rows):
            for left in range(0, cols, sub_cols):
                ids = [grid[r][c] for r in range(top, top + sub_rows) for c in range(left, left + sub_cols)]
                submeshes.append(EmulatedMesh((sub_rows, sub_cols), ids, parent=self))
        return submeshes

    def __repr__(self) -> str:
        rows, cols = self.shape
        return f"EmulatedMesh({rows}x{cols}, devices {list(self.device_ids)})"


def placement(name: str, meshes: Iterable[EmulatedMesh | None], default: EmulatedMesh) -> EmulatedMesh:
    """The one mesh an op's tensors (and ``device`` argument) live on; ``default`` when none names one."""
    found = {id(m): m for m in meshes if m is not None}
    if len(found) > 1:
        from .emulation import EmulationError

        listed = ", ".join(repr(m) for m in found.values())
        raise EmulationError(f"ttnn.{name} touches tensors of different meshes ({listed}): a tensor lives on one mesh")
    return next(iter(found.values()), default)
