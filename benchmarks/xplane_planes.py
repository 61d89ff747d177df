"""What an xplane trace holds, per plane: lines, event count, most common stats, HLO modules named.

    python benchmarks/xplane_planes.py PATH.xplane.pb

One table row per plane. A diagnostic for reading traces of a new backend (which plane carries
the ops, under which stats).
"""

import collections
import sys

from jax.profiler import ProfileData

from tpulab.evidence.report_kit import table

rows = []
for plane in ProfileData.from_file(sys.argv[1]).planes:
    n, keys, modules = 0, collections.Counter(), collections.Counter()
    for line in plane.lines:
        for ev in line.events:
            n += 1
            stats = dict(ev.stats)
            keys.update(stats.keys())
            if "hlo_module" in stats:
                modules[str(stats["hlo_module"])] += 1
    lines = [ln.name for ln in plane.lines][:8]
    rows.append(
        (repr(plane.name), lines, n, dict(keys.most_common(8)), dict(modules.most_common(4)))
    )
print(table(["plane", "lines (first 8)", "events", "stats (8 most common)", "modules"], rows))
