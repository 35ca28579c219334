"""The process grid: which ranks talk to which, for each kind of parallelism.

Chapter: chapters/08_5d_parallelism.ipynb (the mesh and its rank order); docs/design.md, "The mesh".

A world of dp * pp * cp * tp ranks is laid out as a 4-D grid. The order matters for speed:
tensor parallelism communicates inside every layer, so its ranks are neighbours (innermost,
on the same node's NVLink); pipeline parallelism only passes activations between stages,
so its ranks are furthest apart (outermost). Playbook, "5D parallelism in a nutshell".

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

For dp=2, tp=2 (4 ranks): ranks 0,1 form tp group 0 and ranks 2,3 tp group 1; ranks 0,2
and 1,3 are the dp groups.

A `Mesh` is an explicit object: build it inside the function `picotron.launch.run` runs on
each rank, and pass it (never a global) to everything that communicates. It also carries a
`CommCounter`, `mesh.counter`, for whoever measures: `with comm.counting(mesh.counter): ...`.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from picotron.comm import CommCounter

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost


class Mesh:
    """This rank's place in the dp x pp x cp x tp grid, and a process group per axis."""

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: build it inside the function you pass to "
                               "picotron.launch.run (or under torchrun)")
        self.sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        for axis, size in self.sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}={size!r} must be a positive integer")
        self.world_size = dist.get_world_size()
        if dp * pp * cp * tp != self.world_size:
            raise ValueError(f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * pp * cp * tp} but the world has "
                             f"{self.world_size} ranks; change the sizes or launch {dp * pp * cp * tp} ranks")
        self.rank = dist.get_rank()
        self.coords = self.coords_of(self.rank)
        self.counter = CommCounter()
        # Every rank must create every group, in the same order, even those it is not in.
        self.groups = {axis: self._make_groups(axis) for axis in AXES}
        self.groups["dp_cp"] = self._make_groups(("dp", "cp"))  # gradients average over both

    # ---- coordinates -------------------------------------------------------------------
    def coords_of(self, rank: int) -> dict[str, int]:
        """The (pp, dp, cp, tp) coordinates of a global rank."""
        coords = {}
        for axis in reversed(AXES):  # innermost first
            coords[axis] = rank % self.sizes[axis]
            rank //= self.sizes[axis]
        return coords

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (missing axes: this rank's own)."""
        where = {**self.coords, **coords}
        rank = 0
        for axis in AXES:  # outermost first
            if not 0 <= where[axis] < self.sizes[axis]:
                raise ValueError(f"{axis}={where[axis]} is outside 0..{self.sizes[axis] - 1}")
            rank = rank * self.sizes[axis] + where[axis]
        return rank

    def _make_groups(self, axes) -> dist.ProcessGroup:
        """Create one group per line of the grid along `axes`; return the one holding this rank."""
        axes = (axes,) if isinstance(axes, str) else axes
        others = [a for a in AXES if a not in axes]
        mine = None
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            base = dict(zip(others, fixed))
            ranks = sorted(self.rank_of(**base, **dict(zip(axes, free)))
                           for free in itertools.product(*(range(self.sizes[a]) for a in axes)))
            group = dist.new_group(ranks)  # a group of one rank is valid: its collectives are no-ops
            if self.rank in ranks:
                mine = group
        return mine

    # ---- each axis's rank, size and group, spelled out so that grep and an editor find them ----------
    @property
    def dp_rank(self) -> int:
        """This rank's index along dp (data parallelism: replicas that average gradients)."""
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks that differ from this one only along dp."""
        return self.groups["dp"]

    @property
    def pp_rank(self) -> int:
        """This rank's index along pp (pipeline parallelism: stages of the layers)."""
        return self.coords["pp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The ranks that differ from this one only along pp."""
        return self.groups["pp"]

    @property
    def cp_rank(self) -> int:
        """This rank's index along cp (context parallelism: slices of every sequence)."""
        return self.coords["cp"]

    @property
    def cp_size(self) -> int:
        return self.sizes["cp"]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The ranks that differ from this one only along cp."""
        return self.groups["cp"]

    @property
    def tp_rank(self) -> int:
        """This rank's index along tp (tensor parallelism: slices of every matrix)."""
        return self.coords["tp"]

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """The ranks that differ from this one only along tp."""
        return self.groups["tp"]

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The ranks that differ from this one along dp or cp: they hold the same weights (gradients average here)."""
        return self.groups["dp_cp"]

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.sizes["pp"] - 1

    @property
    def pp_prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.rank_of(pp=self.coords["pp"] - 1)

    @property
    def pp_next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.rank_of(pp=self.coords["pp"] + 1)

    @property
    def cp_prev_rank(self) -> int:
        """Global rank this rank receives from in a context-parallel ring."""
        return self.rank_of(cp=(self.coords["cp"] - 1) % self.sizes["cp"])

    @property
    def cp_next_rank(self) -> int:
        """Global rank this rank sends to in a context-parallel ring."""
        return self.rank_of(cp=(self.coords["cp"] + 1) % self.sizes["cp"])

    def __repr__(self) -> str:
        where = " ".join(f"{a}={self.coords[a]}/{self.sizes[a]}" for a in AXES)
        return f"Mesh(rank {self.rank}: {where})"
