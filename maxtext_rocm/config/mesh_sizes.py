"""The mesh's axis sizes from `cfg.mesh`: -1 entries resolved against the device and process
counts. Below both config/checks.py (which validates with it) and sharding.py (which builds the
mesh with it), so neither imports the other to share it."""

from __future__ import annotations

import math

from maxtext_rocm.config.choices import MESH_AXES
from maxtext_rocm.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def mesh_shape(mesh_cfg, device_count: int, process_count: int = 1) -> dict[str, dict[str, int]]:
    """Resolves -1 entries: ICI axes cover the devices of one host, DCN axes the hosts."""
    _require(device_count % process_count == 0,
             f"{device_count} devices do not split evenly over {process_count} processes")
    resolved = {}
    for group, total in (("ici", device_count // process_count), ("dcn", process_count)):
        sizes = dict(mesh_cfg[group])
        known = math.prod(s for s in sizes.values() if s != -1)
        fill = [a for a, s in sizes.items() if s == -1]
        if fill:
            _require(total % known == 0,
                     f"mesh.{group} sizes multiply to {known}, which does not divide the {total} "
                     f"{'devices per host' if group == 'ici' else 'hosts'}, so mesh.{group}.{fill[0]}=-1 cannot fill it")
            sizes[fill[0]] = total // known
        product = math.prod(sizes.values())
        _require(product == total,
                 f"mesh.{group} sizes ({', '.join(f'{a}={s}' for a, s in sizes.items() if s != 1) or 'all 1'}) "
                 f"multiply to {product} but there are {total} "
                 f"{'devices per host' if group == 'ici' else 'hosts (processes)'}; "
                 f"make the product {total} or set one axis to -1")
        resolved[group] = sizes
    return resolved


def axis_sizes(shape: dict[str, dict[str, int]]) -> dict[str, int]:
    """The size of each mesh axis, ICI and DCN together."""
    return {a: shape["ici"][a] * shape["dcn"][a] for a in MESH_AXES}
