"""`python -m afd_ray.bench [sweep] ...`: the bench (`afd_ray.bench.cli`) or, with
`sweep` first, the A:F sweep (`afd_ray.bench.sweep`)."""

import sys

if sys.argv[1:2] == ["sweep"]:
    from afd_ray.bench.sweep import main

    raise SystemExit(main(sys.argv[2:]))

from afd_ray.bench.cli import main

raise SystemExit(main())
