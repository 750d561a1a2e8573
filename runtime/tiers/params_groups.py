"""A disk pack's group read and replaced whole, outside the step: for checkpoints and the user's model
(runtime/tiers/live.py, driver/usermodel.py). ``DiskParams`` (runtime/tiers/params_disk.py) uses it."""
from __future__ import annotations

from concurrent.futures import wait as wait_all

import torch

PARAM = "param"     # the layout key of a group's weights (optimizer state keys are the optimizer's)


class WholeGroups:
    """``read_group`` and ``write_group`` of ``DiskParams``, whose attributes they use: checkpoints, a group at a
    time."""

    def read_group(self, gid: int) -> dict[tuple[str, str], torch.Tensor]:
        """A group's weights and optimizer state, {(name, key): tensor}, read from its file."""
        self.flush()
        lay = self.layouts[gid]
        with self._lock:
            views = self._kept.get(gid)
        if views is None:
            views = self.store.empty([(s, d) for _, _, s, d in lay])
            self.store.read(gid, into=views).result()
        return {(n, k): v for (n, k, _, _), v in zip(lay, views)}

    def read_weights(self, gid: int) -> dict[str, torch.Tensor]:
        """A group's weights alone, {name: tensor}: the first bytes of its file (its optimizer state, which follows
        them, is not read), or views of the group's buffer where it stays in host memory. An export's unit."""
        self.flush()
        lay = [e for e in self.layouts[gid] if e[1] == PARAM]     # the weights come first in a group's file
        with self._lock:
            kept = self._kept.get(gid)
        if kept is not None:
            views = kept[:len(lay)]
        else:
            views = self.store.empty([(s, d) for _, _, s, d in lay])
            self.store.read(gid, into=views).result()
        return {n: v for (n, _, _, _), v in zip(lay, views)}

    def write_group(self, gid: int, params: dict[str, torch.Tensor], states: dict[str, dict] | None) -> None:
        """Replace a group's weights (those given) and, if ``states`` is given, its optimizer state."""
        cur = self.read_group(gid)
        old = self._reads.pop(gid, None)
        if old is not None:
            wait_all([old[0]])
        self._carried.pop(gid, None)       # the device's copy of the old weights: the file has the new ones
        with self._lock:
            self._kept.pop(gid, None)
        lay, values = [], []
        for n in self.groups[gid]:
            t = self.tensors[n]
            lay.append((n, PARAM, tuple(t.shape), t.dtype))
            values.append(params.get(n, cur[(n, PARAM)]))
        for n in self.groups[gid]:
            t, opt = self.tensors[n], self.optimizers.get(n)
            if opt is None:
                continue
            if states is None:
                for (m, k), v in cur.items():
                    if m == n and k != PARAM:
                        lay.append((n, k, tuple(v.shape), v.dtype))
                        values.append(v)
                continue
            s, small = states.get(n) or {}, {}
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    lay.append((n, k, tuple(v.shape), v.dtype))
                    values.append(v)
                else:
                    small[k] = v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            if s:
                opt.state[t] = small
            else:
                opt.state.pop(t, None)
        views = self.store.empty([(s, d) for _, _, s, d in lay])
        with torch.no_grad():
            for dst, src in zip(views, values):
                dst.copy_(src)
        self._store_state(gid, views)
        self.layouts[gid] = lay
        self._leave(gid)
