"""What an xplane trace holds, per plane: lines, event count, most common stats, HLO modules named.

    python benchmarks/xplane_planes.py PATH.xplane.pb

A diagnostic for reading traces of a new backend (which plane carries the ops, under which stats).
"""

import collections
import sys

from jax.profiler import ProfileData

for plane in ProfileData.from_file(sys.argv[1]).planes:
    n, keys, modules = 0, collections.Counter(), collections.Counter()
    for line in plane.lines:
        for ev in line.events:
            n += 1
            stats = dict(ev.stats)
            keys.update(stats.keys())
            if "hlo_module" in stats:
                modules[str(stats["hlo_module"])] += 1
    print(
        f"{plane.name!r}: lines {[ln.name for ln in plane.lines][:8]}, {n} events, "
        f"stats {dict(keys.most_common(8))}, modules {dict(modules.most_common(4))}"
    )
