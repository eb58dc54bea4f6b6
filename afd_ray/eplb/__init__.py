"""Which FFN rank holds which routed expert: the contiguous EP blocks (`contiguous`),
EPLB's pure placement policy (`policy`), the physical slots an EP rank holds and how
balanced a placement is (`slots`), and the records `/afd/status` shows (`records`).
Pure: no process, no Ray; both the control plane (`afd_ray.control`) and the FFN role
(`afd_ray.ffn`) import it (docs/eplb.md)."""
