"""`python -m afd_ray.bench`: see `afd_ray.bench.cli`."""

from afd_ray.bench.cli import main

raise SystemExit(main())
