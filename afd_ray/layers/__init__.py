"""Model code of the FFN side, shared by both roles: the family registry (`family`),
the layout dataclasses (`spec`), and the layers (`mlp`, `routing`, `experts`, `moe`,
`fused`). It knows nothing about processes or transports: it imports nothing from
`afd_ray.ffn`, `attention`, `serve`, `control` or `connector`."""
